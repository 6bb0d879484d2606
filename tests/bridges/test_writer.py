import errno
import json
import os
import re
import struct

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from loongforge_hf.bridges import writer as writer_module
from loongforge_hf.bridges.checkpoint_io import CheckpointError, CheckpointReader
from loongforge_hf.bridges.writer import CheckpointWriter, parse_size


@pytest.fixture(scope="module")
def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def snapshot(folder):
    """Every file under ``folder`` with its bytes, to compare a folder before and after."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if re.match(r"\..*\.(tmp|old)-", p.name))


@pytest.mark.parametrize("size", ["5GB", "5GiB", "500MB", "20KB", "3MiB", "1KiB", "7Gb", "40Mb", "9Kb", 12345, 0])
def test_parse_size_matches_transformers(size):
    assert parse_size(size) == convert_file_size_to_int(size)


def test_parse_size_values_and_errors():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5GiB") == 5 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(" 2 MB ") == 2 * 10**6
    for bad in ("abc", "5TB", "1.5GB", "GB", "-5GB", True, 3.0):
        with pytest.raises(ValueError, match="Cannot read size"):
            parse_size(bad)


def test_round_trip_through_safetensors_and_transformers(tiny_llama, tmp_path):
    state = tiny_llama.state_dict()
    out = tmp_path / "out"
    with CheckpointWriter(out, max_shard_size="10KB") as w:
        for name, tensor in state.items():
            w.add(name, tensor)
        w.write_text("config.json", tiny_llama.config.to_json_string())
    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    assert files == sorted(shards + ["config.json", "model.safetensors.index.json"])
    assert leftovers(tmp_path) == []

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert sorted(index["weight_map"]) == sorted(state) and set(index["weight_map"].values()) == set(shards)

    seen = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                seen[name] = f.get_tensor(name)
    assert sorted(seen) == sorted(state)
    assert all(torch.equal(seen[k], state[k]) for k in state)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    reloaded_state = reloaded.state_dict()
    assert sorted(reloaded_state) == sorted(state)
    for name, tensor in state.items():
        assert reloaded_state[name].dtype == tensor.dtype
        assert torch.equal(reloaded_state[name].view(torch.int32), tensor.view(torch.int32)), name
    with CheckpointReader(out) as reader:
        assert all(torch.equal(reader.get(k), state[k]) for k in state)


def test_shards_and_index_identical_to_transformers_save_pretrained(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
    with CheckpointWriter(tmp_path / "ours", max_shard_size="10KB") as w:
        for name, tensor in tiny_llama.state_dict().items():
            w.add(name, tensor)
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    ours = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert (tmp_path / "ours" / "model.safetensors.index.json").read_text().endswith("}\n")


def test_single_shard_is_model_safetensors(tiny_llama, tmp_path):
    out = tmp_path / "single"
    with CheckpointWriter(out, max_shard_size="5GB", metadata={"producer": "loongforge-hf"}) as w:
        for name, tensor in tiny_llama.state_dict().items():
            w.add(name, tensor)
        w.write_text("config.json", tiny_llama.config.to_json_string())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "producer": "loongforge-hf"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in tiny_llama.state_dict().items())


def test_tensor_larger_than_max_shard_size_gets_its_own_shard(tmp_path):
    with CheckpointWriter(tmp_path / "o", max_shard_size=100) as w:
        w.add("small.a", torch.zeros(5))        # 20 bytes
        w.add("big", torch.zeros(50))           # 200 bytes > 100
        w.add("small.b", torch.zeros(5))
    wm = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())["weight_map"]
    assert wm == {"small.a": "model-00001-of-00003.safetensors", "big": "model-00002-of-00003.safetensors",
                  "small.b": "model-00003-of-00003.safetensors"}


def test_tensors_are_detached_contiguous_copies(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    param = torch.nn.Parameter(torch.ones(3, 3))
    buffer = torch.zeros(4)
    with CheckpointWriter(tmp_path / "o") as w:
        w.add("transposed", base.t())          # non-contiguous view
        w.add("row", base[1])                  # view into a larger storage
        w.add("same", base)                    # shares storage with the two above
        w.add("alias", base)                   # the very same tensor under a second name (tied weights)
        w.add("param", param)                  # requires grad
        w.add("reused", buffer)
        buffer.fill_(7.0)                      # the caller reuses its buffer after add()
    with CheckpointReader(tmp_path / "o") as reader:
        assert torch.equal(reader.get("transposed"), base.t())
        assert torch.equal(reader.get("row"), base[1])
        assert torch.equal(reader.get("same"), base) and torch.equal(reader.get("alias"), base)
        assert torch.equal(reader.get("param"), torch.ones(3, 3))
        assert torch.equal(reader.get("reused"), torch.zeros(4))


def test_side_files(tmp_path):
    src = tmp_path / "tokenizer.json"
    src.write_text('{"tok": 1}')
    with CheckpointWriter(tmp_path / "o") as w:
        w.add("w", torch.zeros(2))
        w.copy_file("tokenizer.json", src)
        w.copy_file("sub/dir/tokenizer.json", src)
        w.write_text("README.md", "héllo\n")
    out = tmp_path / "o"
    assert (out / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (out / "sub" / "dir" / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (out / "README.md").read_text(encoding="utf-8") == "héllo\n"


@pytest.mark.parametrize("relpath,message", [
    ("../escape.txt", "must be a relative path inside"),
    ("a/../../escape.txt", "must be a relative path inside"),
    ("/etc/passwd", "must be a relative path inside"),
    ("", "must be a relative path inside"),
    ("model.safetensors", "is a weights file name"),
    ("model-00001-of-00002.safetensors", "is a weights file name"),
])
def test_bad_side_file_paths(tmp_path, relpath, message):
    out = tmp_path / "o"
    with pytest.raises(CheckpointError, match=message):
        with CheckpointWriter(out) as w:
            w.write_text(relpath, "x")
    assert not out.exists() and leftovers(tmp_path) == []
    assert not (tmp_path / "escape.txt").exists()


def test_duplicates_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"Tensor 'w' was added twice"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.add("w", torch.zeros(2))
            w.add("w", torch.ones(2))
    with pytest.raises(CheckpointError, match=r"'\./config\.json' was written twice"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.write_text("config.json", "{}")
            w.write_text("./config.json", "{}")
    with pytest.raises(CheckpointError, match="not a file"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.copy_file("vocab.txt", tmp_path / "absent.txt")
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


@pytest.fixture
def existing_out(tmp_path):
    out = tmp_path / "out"
    with CheckpointWriter(out) as w:
        w.add("old", torch.full((3,), 1.5))
        w.write_text("config.json", '{"old": true}')
    (out / "notes.txt").write_text("user notes")
    return out


def test_exception_in_with_block_leaves_out_dir_untouched(existing_out):
    before = snapshot(existing_out)
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(existing_out, max_shard_size=8) as w:
            w.add("a", torch.zeros(4))
            w.add("b", torch.zeros(4))        # the first shard is on disk by now
            w.write_text("config.json", "{}")
            raise RuntimeError("boom")
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []


@pytest.mark.parametrize("when", ["mid-stream", "at-exit"])
def test_disk_full_leaves_out_dir_untouched(existing_out, monkeypatch, when):
    before = snapshot(existing_out)
    calls = []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(writer_module, "save_file", full_disk)
    with pytest.raises(CheckpointError, match=rf"disk full while writing shard-00001\.safetensors in {existing_out}"):
        with CheckpointWriter(existing_out, max_shard_size=8 if when == "mid-stream" else "5GB") as w:
            w.add("a", torch.zeros(4))
            w.add("b", torch.zeros(4))
    assert len(calls) == 1
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []


def test_disk_full_for_a_new_folder_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "save_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(CheckpointError, match="disk full"):
        with CheckpointWriter(tmp_path / "new") as w:
            w.add("a", torch.zeros(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_clean_exit_replaces_existing_out_dir(existing_out):
    with CheckpointWriter(existing_out) as w:
        w.add("new", torch.full((2,), 2.5))
    assert sorted(p.name for p in existing_out.iterdir()) == ["model.safetensors"]
    with CheckpointReader(existing_out) as reader:
        assert reader.keys() == ["new"] and torch.equal(reader.get("new"), torch.full((2,), 2.5))
    assert leftovers(existing_out.parent) == []


def test_refuses_to_replace_the_working_directory(tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "inner").mkdir(parents=True)
    (work / "precious.txt").write_text("keep")
    for target, cwd in ((".", work), (str(work), work / "inner")):
        monkeypatch.chdir(cwd)
        with pytest.raises(CheckpointError, match="working directory"):
            with CheckpointWriter(target) as w:
                w.add("a", torch.zeros(1))
    assert (work / "precious.txt").read_text() == "keep"
    assert leftovers(tmp_path) == [] and leftovers(work) == []


def test_misuse(tmp_path):
    w = CheckpointWriter(tmp_path / "o")
    with pytest.raises(RuntimeError, match="with block"):
        w.add("a", torch.zeros(1))
    with pytest.raises(ValueError, match="max_shard_size must be positive"):
        CheckpointWriter(tmp_path / "o", max_shard_size=0)
    with pytest.raises(ValueError, match="strings to strings"):
        CheckpointWriter(tmp_path / "o", metadata={"step": 3})
    with pytest.raises(CheckpointError, match="meta device"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.add("a", torch.empty(2, device="meta"))
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


# ---- planned (streaming) mode -------------------------------------------------------------------------------------

def plan_of(state):
    return [(name, tuple(t.shape), t.dtype) for name, t in state.items()]


def header_of(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def test_planned_matches_buffered_and_transformers(tiny_llama, tmp_path):
    """Same shards, index and tensors as without a plan (and as transformers'), readable by transformers."""
    state = tiny_llama.state_dict()
    for mode in ("buffered", "planned"):
        with CheckpointWriter(tmp_path / mode, max_shard_size="10KB") as w:
            if mode == "planned":
                w.plan(plan_of(state))
            for name, tensor in state.items():
                w.add(name, tensor)
            w.write_text("config.json", tiny_llama.config.to_json_string())
    tiny_llama.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
    ours = (tmp_path / "planned" / "model.safetensors.index.json").read_text()
    assert ours == (tmp_path / "buffered" / "model.safetensors.index.json").read_text()
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert json.loads(ours)["weight_map"] == theirs["weight_map"]
    for shard in sorted((tmp_path / "planned").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f, safe_open(str(tmp_path / "buffered" / shard.name), "pt") as g:
            assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(g.keys())
            assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "planned")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in state.items())


def test_planned_shard_is_byte_identical_to_save_file(tmp_path):
    """One dtype, planned in name order: exactly the bytes safetensors' own save_file writes."""
    state = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7), "c": torch.randn(2, 2)}
    save_file(state, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    with CheckpointWriter(tmp_path / "o") as w:
        w.plan(plan_of(state))
        for name, tensor in state.items():
            w.add(name, tensor)
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_planned_mixed_dtypes_are_aligned_and_any_add_order_works(tmp_path):
    state = {"odd_bf16": torch.randn(3, 3).to(torch.bfloat16), "f64": torch.randn(5, dtype=torch.float64),
             "flags": torch.tensor([True, False, True]), "i32": torch.arange(7, dtype=torch.int32),
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5)}
    with CheckpointWriter(tmp_path / "o") as w:
        w.plan(plan_of(state))
        for name in reversed(list(state)):
            w.add(name, state[name])
    path = tmp_path / "o" / "model.safetensors"
    n, header = header_of(path)
    assert (8 + n) % 8 == 0
    for name, tensor in state.items():
        begin, end = header[name]["data_offsets"]
        assert begin % tensor.element_size() == 0 and end - begin == tensor.numel() * tensor.element_size(), name
    with CheckpointReader(tmp_path / "o") as reader:
        for name, tensor in state.items():
            assert torch.equal(reader.get(name), tensor), name


def test_planned_tensor_is_on_disk_when_add_returns(tmp_path):
    """Nothing is held back or copied: the bytes are in the shard before add() returns."""
    weight = torch.arange(6, dtype=torch.float32)
    with CheckpointWriter(tmp_path / "o") as w:
        w.plan([("w", (6,), torch.float32), ("later", (2,), torch.float32)])
        w.add("w", weight)
        weight.fill_(-1.0)
        (shard,) = list(w._folder.tmp.glob("*.safetensors"))
        n, header = header_of(shard)
        begin, end = header["w"]["data_offsets"]
        assert shard.read_bytes()[8 + n + begin:8 + n + end] == torch.arange(6, dtype=torch.float32).numpy().tobytes()
        w.add("later", torch.ones(2))


def test_tensors_beyond_the_plan_go_to_shards_after_it(tmp_path):
    with CheckpointWriter(tmp_path / "o", max_shard_size=90) as w:
        w.plan([("p1", (20,), torch.float32), ("p2", (5,), torch.float32)])  # 80 + 20 bytes > 90: two shards
        w.add("extra", torch.ones(3))
        w.add("p2", torch.full((5,), 2.0))
        w.add("p1", torch.zeros(20))
    wm = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())["weight_map"]
    assert wm == {"p1": "model-00001-of-00003.safetensors", "p2": "model-00002-of-00003.safetensors",
                  "extra": "model-00003-of-00003.safetensors"}
    with CheckpointReader(tmp_path / "o") as reader:
        assert torch.equal(reader.get("extra"), torch.ones(3)) and torch.equal(reader.get("p2"), torch.full((5,), 2.0))


@pytest.mark.parametrize("mistake, message", [
    ("shape", r"Tensor 'w' was planned as torch.float32 \[4\] but added as torch.float32 \[5\]"),
    ("dtype", r"Tensor 'w' was planned as torch.float32 \[4\] but added as torch.float16 \[4\]"),
    ("missing", r"1 planned tensor\(s\) were never added .*: v\."),
])
def test_planned_mistakes_leave_nothing(existing_out, mistake, message):
    before = snapshot(existing_out)
    with pytest.raises(CheckpointError, match=message):
        with CheckpointWriter(existing_out) as w:
            w.plan([("w", (4,), torch.float32), ("v", (2,), torch.float32)])
            w.add("w", {"shape": torch.zeros(5), "dtype": torch.zeros(4, dtype=torch.float16)}.get(
                mistake, torch.zeros(4)))
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []


def test_planned_disk_full_leaves_out_dir_untouched(existing_out, monkeypatch):
    before = snapshot(existing_out)
    real = os.pwrite
    writes = []

    def full_after_the_header(fd, data, offset):
        writes.append(offset)
        if offset > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", full_after_the_header)
    with pytest.raises(CheckpointError, match=rf"disk full while writing shard-00001\.safetensors in {existing_out}"):
        with CheckpointWriter(existing_out) as w:
            w.plan([("a", (4,), torch.float32)])
            w.add("a", torch.zeros(4))
    assert writes[0] == 0 and len(writes) == 2
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []


def test_plan_misuse(tmp_path):
    with pytest.raises(RuntimeError, match="before the first add"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.add("a", torch.zeros(1))
            w.plan([("b", (1,), torch.float32)])
    with pytest.raises(CheckpointError, match="given twice"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.plan([("b", (1,), torch.float32), ("b", (1,), torch.float32)])
    with pytest.raises(CheckpointError, match="cannot hold"):
        with CheckpointWriter(tmp_path / "o") as w:
            w.plan([("b", (-1,), torch.float32)])
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_blocks_along_any_dim_write_the_same_bytes_as_whole_tensors(tmp_path):
    """Rows, columns and inner-dim blocks in any order, a 0-d tensor as its one block: shards byte-identical to adding
    whole tensors."""
    state = {"rows": torch.randn(6, 5), "cols": torch.randn(4, 9).to(torch.bfloat16), "cube": torch.randn(3, 4, 6),
             "bias": torch.randn(7), "whole": torch.arange(4, dtype=torch.int32), "scalar": torch.tensor(0.25)}
    blocks = [("cols", 1, 6, 9), ("rows", 0, 2, 6), ("cube", 2, 0, 2), ("bias", 0, 3, 7), ("cols", 1, 0, 2),
              ("rows", 0, 0, 2), ("cube", 2, 2, 6), ("cols", 1, 2, 6), ("bias", 0, 0, 3)]
    for mode in ("whole", "blocks"):
        with CheckpointWriter(tmp_path / mode, max_shard_size=150) as w:
            w.plan(plan_of(state))
            if mode == "blocks":
                for name, dim, start, stop in blocks:
                    w.add_part(name, state[name].narrow(dim, start, stop - start), dim=dim, start=start)
                w.add_part("scalar", state["scalar"], dim=0, start=0)
                w.add("whole", state["whole"])
            else:
                for name, tensor in state.items():
                    w.add(name, tensor)
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "blocks").iterdir()) and len(files) > 2
    for f in files:
        assert (tmp_path / "blocks" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


@pytest.mark.parametrize("mistake, message", [
    ("unplanned", r"tensor 'x' was not planned"),
    ("overlap", r"block 1:3 along dim 0 overlaps"),
    ("other_dim", r"overlaps a block already added, or another block was along dim 0"),
    ("out_of_range", r"planned as torch.float32 \[4, 2\]; a block torch.float32 \[2, 2\] at 3 along dim 0"),
    ("wrong_width", r"a block torch.float32 \[2, 3\] at 0 along dim 0 does not fit"),
    ("dtype", r"a block torch.float64 \[2, 2\] at 0 along dim 0 does not fit"),
    ("after_whole", r"Tensor 'w' was added twice"),
    ("whole_after_part", r"Tensor 'w' was added twice"),
    ("incomplete", r"1 planned tensor\(s\) were never added \(or only in part\) .*: w\."),
    ("scalar_start", r"Tensor 's' was planned as torch.float32 \[\]; a block torch.float32 \[\] at 1 along dim 0 does"),
    ("scalar_twice", r"Tensor 's' was added twice"),
])
def test_block_mistakes_leave_nothing(existing_out, mistake, message):
    before = snapshot(existing_out)
    with pytest.raises(CheckpointError, match=message):
        with CheckpointWriter(existing_out) as w:
            w.plan([("w", (4, 2), torch.float32)] + ([("s", (), torch.float32)] if "scalar" in mistake else []))
            two = torch.zeros(2, 2)
            if mistake.startswith("scalar"):
                w.add_part("s", torch.tensor(1.0), dim=0, start=int(mistake == "scalar_start"))
                w.add_part("s", torch.tensor(1.0), dim=0, start=0)
            elif mistake == "unplanned":
                w.add_part("x", two, dim=0, start=0)
            elif mistake in ("overlap", "other_dim", "incomplete", "whole_after_part"):
                w.add_part("w", two, dim=0, start=0)
                if mistake == "overlap":
                    w.add_part("w", two, dim=0, start=1)
                elif mistake == "other_dim":
                    w.add_part("w", torch.zeros(4, 1), dim=1, start=0)
                elif mistake == "whole_after_part":
                    w.add("w", torch.zeros(4, 2))
            elif mistake == "out_of_range":
                w.add_part("w", two, dim=0, start=3)
            elif mistake == "wrong_width":
                w.add_part("w", torch.zeros(2, 3), dim=0, start=0)
            elif mistake == "dtype":
                w.add_part("w", two.double(), dim=0, start=0)
            elif mistake == "after_whole":
                w.add("w", torch.zeros(4, 2))
                w.add_part("w", two, dim=0, start=0)
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []


def test_threaded_writes_equal_single_threaded_writes(tmp_path, monkeypatch):
    """Whole tensors and blocks of rows/columns of many pages, written in pieces on 4 threads: the same bytes."""
    import threading

    from loongforge_hf.bridges import parallel_io

    torch.manual_seed(0)
    state = {"wide": torch.randn(64, 1000), "tall": torch.randn(2000, 24).to(torch.bfloat16), "bias": torch.randn(9)}
    threads = set()
    real = os.pwrite

    def pwrite(fd, data, offset):
        threads.add(threading.get_ident())
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", pwrite)
    for mode in ("1", "4"):
        monkeypatch.setenv("LOONGFORGE_IO_THREADS", mode)
        monkeypatch.setattr(parallel_io, "_CHUNK_BYTES", 8192)
        threads.clear()
        with CheckpointWriter(tmp_path / mode, max_shard_size=200_000) as w:
            w.plan(plan_of(state))
            w.add("wide", state["wide"])
            w.add_part("tall", state["tall"][:, 10:], dim=1, start=10)
            w.add_part("tall", state["tall"][:, :10], dim=1, start=0)
            w.add_part("bias", state["bias"][4:], dim=0, start=4)
            w.add_part("bias", state["bias"][:4], dim=0, start=0)
        assert (len(threads) > 1) == (mode == "4")
    save_file(state, str(tmp_path / "reference.safetensors"))
    files = sorted(p.name for p in (tmp_path / "1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "4").iterdir()) and len(files) == 3  # 2 shards + index
    for f in files:
        assert (tmp_path / "4" / f).read_bytes() == (tmp_path / "1" / f).read_bytes(), f
    with CheckpointReader(tmp_path / "4") as reader:
        assert all(torch.equal(reader.get(n), t) for n, t in state.items())


def test_threaded_write_with_one_failed_piece_leaves_out_dir_untouched(existing_out, monkeypatch):
    from loongforge_hf.bridges import parallel_io

    monkeypatch.setenv("LOONGFORGE_IO_THREADS", "4")
    monkeypatch.setattr(parallel_io, "_CHUNK_BYTES", 8192)
    before = snapshot(existing_out)
    real = os.pwrite
    offsets = []

    def one_piece_fails(fd, data, offset):
        offsets.append(offset)
        if 300_000 < offset < 500_000:  # the third of four pieces of 200 KB
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", one_piece_fails)
    with pytest.raises(CheckpointError, match=rf"disk full while writing shard-00001\.safetensors in {existing_out}"):
        with CheckpointWriter(existing_out) as w:
            w.plan([("a", (200, 1000), torch.float32)])
            w.add("a", torch.zeros(200, 1000))
    assert len(offsets) == 5  # the header, then the 4 pieces
    assert snapshot(existing_out) == before
    assert leftovers(existing_out.parent) == []
