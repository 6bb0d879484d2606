import json
import os
import shutil
import struct
import threading
import time

import pytest
import torch
import transformers
from safetensors.torch import save_file

from loongforge_hf.bridges import checkpoint_io, parallel_io
from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama saved by transformers itself, in several shards; returns (folder, state_dict)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder, max_shard_size="10KB")
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def llama_copy(tiny_llama, tmp_path):
    """A private copy of the sharded checkpoint that a test may damage."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_llama[0], folder)
    return folder


def weight_map(folder):
    return json.loads((folder / INDEX).read_text())["weight_map"]


def rewrite_index(folder, tensor, shard):
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"][tensor] = shard
    (folder / INDEX).write_text(json.dumps(index))


def test_reads_transformers_sharded_checkpoint_bit_exact(tiny_llama):
    folder, state = tiny_llama
    assert len(set(weight_map(folder).values())) >= 3
    with CheckpointReader(folder) as reader:
        assert sorted(reader.keys()) == sorted(state)
        assert len(reader) == len(state)
        for name, tensor in state.items():
            assert name in reader
            assert reader.shape(name) == tuple(tensor.shape)
            assert reader.dtype(name) == tensor.dtype
            assert torch.equal(reader.get(name), tensor), name
        assert "nope" not in reader


def test_shards_open_lazily(tiny_llama):
    folder, _ = tiny_llama
    wm = weight_map(folder)
    reader = CheckpointReader(folder)
    assert reader.opened_files == set()
    # header-only questions open nothing
    for name in wm:
        reader.shape(name), reader.dtype(name)
    assert reader.opened_files == set()
    name = next(iter(wm))
    reader.get(name)
    assert reader.opened_files == {wm[name]}
    same_shard = [n for n in wm if wm[n] == wm[name] and n != name]
    reader.get_slice(same_shard[0], dim=0, start=0, stop=1)
    assert reader.opened_files == {wm[name]}
    other = next(n for n in wm if wm[n] != wm[name])
    reader.get_slice(other, dim=0, start=0, stop=1)
    assert reader.opened_files == {wm[name], wm[other]}
    reader.close()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_get_slice_equals_get(tiny_llama, dim):
    folder, state = tiny_llama
    name = "model.layers.1.mlp.gate_proj.weight"  # [32, 16]
    with CheckpointReader(folder) as reader:
        full = reader.get(name)
        size = full.shape[dim]
        for start, stop in [(0, size), (0, size // 2), (size // 2, size), (3, 7), (5, 5)]:
            got = reader.get_slice(name, dim=dim, start=start, stop=stop)
            assert torch.equal(got, full.narrow(dim, start, stop - start)), (start, stop)
            assert got.is_contiguous()
        bias_like = reader.get_slice("model.norm.weight", dim=0, start=4, stop=12)
        assert torch.equal(bias_like, state["model.norm.weight"][4:12])


def _spy_reads(monkeypatch, limit=None):
    """Record (offset, bytes asked) of each os.preadv call; with ``limit`` every call stops early, as the kernel may."""
    calls = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        calls.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers if limit is None else [buffers[0][:limit]], offset)

    monkeypatch.setattr(checkpoint_io.os, "preadv", preadv)
    return calls


def test_get_slice_reads_only_its_bytes_into_memory_it_owns(tiny_llama, monkeypatch):
    """Rows are one read of just their bytes; columns one stretch from the first to the last run; no file mapping."""
    calls = _spy_reads(monkeypatch)
    folder, state = tiny_llama
    name = "lm_head.weight"  # [64, 16] float32
    with CheckpointReader(folder) as reader:
        rows = reader.get_slice(name, dim=0, start=8, stop=24)
        assert calls == [(calls[0][0], 16 * 16 * 4)]
        calls.clear()
        cols = reader.get_slice(name, dim=1, start=4, stop=12)
        assert sum(n for _, n in calls) == (63 * 16 + 8) * 4  # first run's start to last run's end
        with open("/proc/self/maps") as maps:
            assert reader.folder.name not in maps.read()  # NOTE: nothing of the checkpoint is memory-mapped
    assert torch.equal(rows, state[name][8:24]) and torch.equal(cols, state[name][:, 4:12])
    for part in (rows, cols):
        assert part.is_contiguous() and part.untyped_storage().nbytes() == part.numel() * part.element_size()


@pytest.mark.parametrize("pickled", [False, True])
def test_get_slice_into_a_block_of_a_larger_tensor(tiny_llama, tmp_path, pickled):
    """``out=``: rows and columns read straight into their place; a destination that does not fit is refused."""
    folder, state = tiny_llama
    if pickled:
        torch.save(state, tmp_path / "pytorch_model.bin")
        folder = tmp_path
    name = "lm_head.weight"  # [64, 16] float32
    big = torch.full((40, 16), -1.0)
    with CheckpointReader(folder, allow_pickle=pickled) as reader:
        assert reader.get_slice(name, dim=0, start=8, stop=24, out=big[10:26]).data_ptr() == big[10].data_ptr()
        cols = torch.empty(64, 8)
        assert reader.get_slice(name, dim=1, start=4, stop=12, out=cols) is cols
        for bad in (big[10:27], big[10:26].double(), torch.empty(16, 32)[:, :16]):
            with pytest.raises(CheckpointError, match=r"cannot read torch.float32 \[16, 16\] into"):
                reader.get_slice(name, dim=0, start=8, stop=24, out=bad)
    assert torch.equal(big[10:26], state[name][8:24]) and torch.equal(cols, state[name][:, 4:12])
    assert (big[:10] == -1).all() and (big[26:] == -1).all()


@pytest.mark.parametrize("limit", [None, 13])
def test_reads_of_many_runs_and_short_reads(tmp_path, monkeypatch, limit):
    """More runs than one preadv call takes (IOV_MAX), odd dims and a kernel that returns a few bytes at a time."""
    calls = _spy_reads(monkeypatch, limit)
    tensors = {"many_rows": torch.arange(3000 * 6, dtype=torch.int16).reshape(3000, 6),
               "cube": torch.randn(5, 7, 9, dtype=torch.bfloat16), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with CheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.get_slice("many_rows", dim=1, start=1, stop=4), tensors["many_rows"][:, 1:4])
        for dim in range(3):
            size = tensors["cube"].shape[dim]
            got = reader.get_slice("cube", dim=dim, start=1, stop=size - 2)
            assert torch.equal(got, tensors["cube"].narrow(dim, 1, size - 3)), dim
        for name, tensor in tensors.items():
            got = reader.get(name)
            assert got.shape == tensor.shape and got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert len(calls) > 1


def test_shard_truncated_after_opening_names_file_and_tensor(llama_copy):
    reader = CheckpointReader(llama_copy)
    name = "lm_head.weight"
    shard = reader.shard_of(name)
    os.truncate(llama_copy / shard, 100)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated while reading tensor 'lm_head\.weight'"):
        reader.get(name)
    reader.close()


def test_get_slice_out_of_range(tiny_llama):
    with CheckpointReader(tiny_llama[0]) as reader:
        with pytest.raises(CheckpointError, match=r"lm_head\.weight.*slice 60:70 along dim 0"):
            reader.get_slice("lm_head.weight", dim=0, start=60, stop=70)
        with pytest.raises(CheckpointError, match="dim 2 is out of range"):
            reader.get_slice("lm_head.weight", dim=2, start=0, stop=1)


def test_unknown_tensor_is_named(tiny_llama):
    with CheckpointReader(tiny_llama[0]) as reader:
        for ask in (reader.get, reader.shape, reader.dtype):
            with pytest.raises(CheckpointError, match=r"'model\.layers\.9\.mlp\.up_proj\.weight' is not in"):
                ask("model.layers.9.mlp.up_proj.weight")


def test_validate_shapes(tiny_llama):
    folder, state = tiny_llama
    with CheckpointReader(folder) as reader:
        reader.validate_shapes({k: tuple(v.shape) for k, v in state.items()})
        with pytest.raises(CheckpointError) as err:
            reader.validate_shapes({"lm_head.weight": (128, 16), "model.extra.weight": (2, 2),
                                    "model.norm.weight": (16,)})
    message = str(err.value)
    assert "'lm_head.weight': expected shape (128, 16), found (64, 16)" in message
    assert "'model.extra.weight': missing (expected shape (2, 2))" in message
    assert "model.norm.weight" not in message
    assert "2 tensor(s)" in message


def test_single_file_checkpoint(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16), "d": torch.tensor([True, False])}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with CheckpointReader(tmp_path) as reader:
        assert sorted(reader.keys()) == ["a", "b", "c", "d"]
        for name, tensor in tensors.items():
            assert reader.dtype(name) == tensor.dtype
            assert torch.equal(reader.get(name), tensor)
        assert torch.equal(reader.get_slice("a", dim=1, start=1, stop=4), tensors["a"][:, 1:4])
        assert reader.opened_files == {"model.safetensors"}


def test_single_file_wins_over_index_as_in_transformers(llama_copy):
    save_file({"only": torch.ones(3)}, str(llama_copy / "model.safetensors"))
    with CheckpointReader(llama_copy) as reader:
        assert reader.keys() == ["only"]


def test_missing_shard_names_file_and_tensor(llama_copy):
    wm = weight_map(llama_copy)
    victim = sorted(set(wm.values()))[1]
    (llama_copy / victim).unlink()
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(llama_copy)
    assert victim in str(err.value) and "missing" in str(err.value)
    assert any(repr(t) in str(err.value) for t, s in wm.items() if s == victim)


def test_corrupt_header_names_file(llama_copy):
    shard = sorted(set(weight_map(llama_copy).values()))[0]
    data = bytearray((llama_copy / shard).read_bytes())
    data[8:12] = b"\xff\xfe{{"
    (llama_copy / shard).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard}: corrupt safetensors header"):
        CheckpointReader(llama_copy)


@pytest.mark.parametrize("keep", [4, 40, "half", "minus1"])
def test_truncated_shard_names_file(llama_copy, keep):
    shard = sorted(set(weight_map(llama_copy).values()))[-1]
    data = (llama_copy / shard).read_bytes()
    cut = {"half": len(data) // 2, "minus1": len(data) - 1}.get(keep, keep)
    (llama_copy / shard).write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=f"{shard}: .*truncated"):
        CheckpointReader(llama_copy)


def test_header_whose_byte_range_does_not_match_dtype(tmp_path):
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["w"]["shape"] = [4, 2]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    (tmp_path / "model.safetensors").write_bytes(raw[:8] + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header: tensor 'w'"):
        CheckpointReader(tmp_path)


def test_index_that_does_not_parse(llama_copy):
    (llama_copy / INDEX).write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match=f"{INDEX}: not a valid checkpoint index"):
        CheckpointReader(llama_copy)
    (llama_copy / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=f"{INDEX}: the checkpoint index has no 'weight_map'"):
        CheckpointReader(llama_copy)


def test_index_entry_for_tensor_absent_from_its_shard(llama_copy):
    wm = weight_map(llama_copy)
    wrong = next(s for s in sorted(set(wm.values())) if s != wm["lm_head.weight"])
    rewrite_index(llama_copy, "lm_head.weight", wrong)
    with pytest.raises(CheckpointError, match=f"tensor 'lm_head.weight' in '{wrong}', but that shard does not hold"):
        CheckpointReader(llama_copy)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_shard_paths_must_stay_inside_the_folder(llama_copy, tmp_path, kind):
    outside = tmp_path / "outside.safetensors"
    save_file({"lm_head.weight": torch.zeros(64, 16)}, str(outside))
    if kind == "dotdot":
        entry, expected = "../outside.safetensors", r"leaves the checkpoint folder \('\.\.'\)"
    elif kind == "absolute":
        entry, expected = str(outside), "an absolute path"
    else:
        (llama_copy / "linked.safetensors").symlink_to(outside)
        entry, expected = "linked.safetensors", "outside the checkpoint folder"
    rewrite_index(llama_copy, "lm_head.weight", entry)
    with pytest.raises(CheckpointError, match=expected) as err:
        CheckpointReader(llama_copy)
    assert "lm_head.weight" in str(err.value)


def test_symlink_inside_the_folder_is_fine(llama_copy):
    wm = weight_map(llama_copy)
    shard = wm["lm_head.weight"]
    (llama_copy / "sub").mkdir()
    (llama_copy / shard).rename(llama_copy / "sub" / "real.safetensors")
    (llama_copy / shard).symlink_to(llama_copy / "sub" / "real.safetensors")
    with CheckpointReader(llama_copy) as reader:
        assert reader.shape("lm_head.weight") == (64, 16)


def test_pickle_refused_unless_allowed(tiny_llama, tmp_path):
    _, state = tiny_llama
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickle checkpoints are refused unless allow_pickle=True"):
        CheckpointReader(tmp_path)
    with CheckpointReader(tmp_path, allow_pickle=True) as reader:
        assert sorted(reader.keys()) == sorted(state)
        for name, tensor in state.items():
            assert reader.shape(name) == tuple(tensor.shape) and reader.dtype(name) == tensor.dtype
            assert torch.equal(reader.get(name), tensor)
        assert torch.equal(reader.get_slice("lm_head.weight", dim=1, start=2, stop=5), state["lm_head.weight"][:, 2:5])
        reader.validate_shapes({"lm_head.weight": (64, 16)})


def test_sharded_pickle_checkpoint(tiny_llama, tmp_path):
    _, state = tiny_llama
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, keys in halves.items():
        torch.save({k: state[k] for k in keys}, tmp_path / file)
    wm = {k: file for file, keys in halves.items() for k in keys}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin\.index\.json.*allow_pickle=True"):
        CheckpointReader(tmp_path)
    reader = CheckpointReader(tmp_path, allow_pickle=True)
    assert reader.opened_files == set()
    assert torch.equal(reader.get(names[0]), state[names[0]])
    assert reader.opened_files == {"pytorch_model-00001-of-00002.bin"}
    for name in names:
        assert torch.equal(reader.get(name), state[name])
    reader.close()


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path):
    torch.save({"w": torch.zeros(2), "evil": {"not": "a tensor"}, "f": os.getcwd}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        CheckpointReader(tmp_path, allow_pickle=True)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"No weights found in {tmp_path}"):
        CheckpointReader(tmp_path)
    save_file({"w": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match=r"found consolidated\.safetensors, but not under transformers' names"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        CheckpointReader(tmp_path / "absent")


def test_io_threads_from_env_cpus_and_local_processes(monkeypatch):
    monkeypatch.setattr(checkpoint_io.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOONGFORGE_IO_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parallel_io.io_threads() == 16  # capped
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parallel_io.io_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert parallel_io.io_threads() == 1
    monkeypatch.setenv("LOONGFORGE_IO_THREADS", "3")
    assert parallel_io.io_threads() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("LOONGFORGE_IO_THREADS", bad)
        with pytest.raises(ValueError, match="LOONGFORGE_IO_THREADS must be a positive integer"):
            parallel_io.io_threads()


@pytest.fixture
def big_tensors(tmp_path):
    """Tensors of many pages each, in one file: rows, columns and whole reads split into several pieces."""
    torch.manual_seed(0)
    tensors = {"wide": torch.randn(96, 1000), "tall": torch.randn(3000, 24).to(torch.bfloat16),
               "cube": torch.randn(6, 50, 70), "small": torch.randn(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def _all_reads(folder):
    """Every whole tensor and a slice along every dim of each, read with the current settings."""
    with CheckpointReader(folder) as reader:
        got = {}
        for name in reader.keys():
            got[name] = reader.get(name)
            for dim, size in enumerate(reader.shape(name)):
                got[name, dim] = reader.get_slice(name, dim=dim, start=1, stop=size - 1)
        return got


def test_threaded_reads_equal_single_threaded_reads(big_tensors, monkeypatch):
    folder, tensors = big_tensors
    threads = set()
    real = os.preadv

    def preadv(fd, buffers, offset):
        threads.add(threading.get_ident())
        return real(fd, buffers, offset)

    monkeypatch.setattr(checkpoint_io.os, "preadv", preadv)
    monkeypatch.setenv("LOONGFORGE_IO_THREADS", "1")
    single = _all_reads(folder)
    assert len(threads) == 1
    monkeypatch.setenv("LOONGFORGE_IO_THREADS", "4")
    monkeypatch.setattr(parallel_io, "_CHUNK_BYTES", 8192)
    threads.clear()
    multi = _all_reads(folder)
    assert len(threads) > 1  # NOTE: the reads did go through several threads
    assert single.keys() == multi.keys()
    for key, value in single.items():
        assert multi[key].dtype == value.dtype and torch.equal(multi[key], value), key
        name, dim = key if isinstance(key, tuple) else (key, None)
        expected = tensors[name] if dim is None else tensors[name].narrow(dim, 1, tensors[name].shape[dim] - 2)
        assert torch.equal(value, expected), key


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_failed_piece_of_a_threaded_read_names_the_tensor_after_the_others_end(big_tensors, monkeypatch, dim):
    folder, _ = big_tensors
    monkeypatch.setenv("LOONGFORGE_IO_THREADS", "4")
    monkeypatch.setattr(parallel_io, "_CHUNK_BYTES", 8192)
    real = os.preadv
    done = []

    with CheckpointReader(folder) as reader:
        first = reader._info("wide").offset

        def preadv(fd, buffers, offset):
            if offset == first:  # the first piece fails at once, the others take their time
                raise OSError(5, "Input/output error")
            time.sleep(0.02)
            got = real(fd, buffers, offset)
            done.append(offset)
            return got

        monkeypatch.setattr(checkpoint_io.os, "preadv", preadv)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: reading tensor 'wide' failed \(.*Input/output"):
            if dim is None:
                reader.get("wide")
            else:
                reader.get_slice("wide", dim=dim, start=0, stop=50)
        finished = len(done)
        assert finished >= 1
        time.sleep(0.1)
        assert len(done) == finished  # NOTE: no piece was still running when the error came out


def test_integer_tensors_declared_as_such(tmp_path):
    """An ``IntegerShape`` (DeepSeek-V4's ``tid2eid``) wants integers where every other tensor wants floating point:
    each kind stored as the other is listed, naming its dtype."""
    from loongforge_hf.bridges.checkpoint_io import IntegerShape

    save_file({"table": torch.zeros(4, 2, dtype=torch.int64), "weight": torch.zeros(4, 2)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with CheckpointReader(tmp_path) as reader:
        reader.validate_shapes({"table": IntegerShape((4, 2)), "weight": (4, 2)})
        with pytest.raises(CheckpointError) as err:
            reader.validate_shapes({"table": (4, 2), "weight": IntegerShape((4, 2))})
    assert "'table': stored as torch.int64 in model.safetensors, expected floating point" in str(err.value)
    assert "'weight': stored as torch.float32 in model.safetensors, expected integers" in str(err.value)
