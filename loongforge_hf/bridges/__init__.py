"""HF <-> megatron-core bridges: one small declaration per architecture, shared machinery beside them."""

# NOTE: importing a bridge module registers its architectures.
from loongforge_hf.bridges import falcon  # noqa: F401
from loongforge_hf.bridges import gpt2  # noqa: F401
from loongforge_hf.bridges import gpt_bigcode  # noqa: F401
from loongforge_hf.bridges import llama4  # noqa: F401
from loongforge_hf.bridges import dots1  # noqa: F401
from loongforge_hf.bridges import dbrx, exaone_moe, solar_open  # noqa: F401
from loongforge_hf.bridges import mimo_v2_flash  # noqa: F401
from loongforge_hf.bridges import hunyuan_v1_dense, hunyuan_v1_moe  # noqa: F401
from loongforge_hf.bridges import apertus, exaone, flex_olmo, granitemoeshared  # noqa: F401
from loongforge_hf.bridges import minimax_m2  # noqa: F401
from loongforge_hf.bridges import jais2, phimoe  # noqa: F401
from loongforge_hf.bridges import afmoe, cohere2_moe  # noqa: F401
from loongforge_hf.bridges import qwen3_5  # noqa: F401
from loongforge_hf.bridges import glm4_moe_lite, minicpm3, mistral4  # noqa: F401
from loongforge_hf.bridges import deepseek_v32, glm_moe_dsa  # noqa: F401
from loongforge_hf.bridges import beam, deepseek_v4  # noqa: F401
from loongforge_hf.bridges import hy_v4  # noqa: F401
from loongforge_hf.bridges import axk1, axk2  # noqa: F401
from loongforge_hf.bridges import gemma4  # noqa: F401
from loongforge_hf.bridges import gemma3n  # noqa: F401
from loongforge_hf.bridges import lfm2, lfm2_moe, lfm3  # noqa: F401
from loongforge_hf.bridges import bamba, falcon_h1, granitemoehybrid, nemotron_h  # noqa: F401
from loongforge_hf.bridges import jamba, mamba2_lm, mamba_lm  # noqa: F401
from loongforge_hf.bridges import qwen3_5_moe, qwen3_next  # noqa: F401
from loongforge_hf.bridges import bailing_hybrid_refused, lara_mini, qwen4_exp_refused  # noqa: F401
from loongforge_hf.bridges import dory_zaya_refused  # noqa: F401
from loongforge_hf.bridges import glm, nemotron, olmo  # noqa: F401
from loongforge_hf.bridges import olmo_hybrid  # noqa: F401
from loongforge_hf.bridges import kimi_linear  # noqa: F401
from loongforge_hf.bridges import minimax  # noqa: F401
from loongforge_hf.bridges import nanochat  # noqa: F401
from loongforge_hf.bridges import classic_refused, codegen, gpt_neo, gpt_neox_japanese, opt, persimmon  # noqa: F401
from loongforge_hf.bridges import biogpt, xglm  # noqa: F401
from loongforge_hf.bridges import flint, hy_v3, mellum, youtu  # noqa: F401
from loongforge_hf.bridges import bitnet, diffllama, granite_swa  # noqa: F401
from loongforge_hf.bridges import aria, kolibri1  # noqa: F401
from loongforge_hf.bridges import jetmoe  # noqa: F401
from loongforge_hf.bridges import laguna  # noqa: F401
from loongforge_hf.bridges import longcat_flash  # noqa: F401
from loongforge_hf.bridges import recurrent_gemma  # noqa: F401
from loongforge_hf.bridges import vlm_text_refused  # noqa: F401
from loongforge_hf.bridges import xlstm_refused  # noqa: F401
from loongforge_hf.bridges import doge  # noqa: F401
from loongforge_hf.bridges import zamba, zamba2  # noqa: F401
from loongforge_hf.bridges import (arcee, cohere, deepseek, ernie4_5_moe, exaone4, gemma, glm4,  # noqa: F401
                                   glm4_moe, gpt_neox, gpt_oss, gptj, granite, llama, mistral, mixtral, olmo2,
                                   olmoe, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, smollm3, stablelm,
                                   starcoder2)
from loongforge_hf.bridges.config_map import UnsupportedConfigError
from loongforge_hf.bridges.registry import (UnsupportedArchitectureError, get_bridge, register_bridge,
                                            supported_architectures)

__all__ = ["UnsupportedArchitectureError", "UnsupportedConfigError", "get_bridge", "register_bridge",
           "supported_architectures"]
