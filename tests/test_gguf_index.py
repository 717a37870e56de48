"""gguf_index reads the same tensors as the gguf package's reader, without decoding the metadata."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from whiflash_core.gguf_index import read_tensors


@pytest.mark.parametrize("alignment", [None, 4096])   # 4096: the data starts elsewhere than at 32
def test_the_tensors_are_the_gguf_readers_after_every_kind_of_metadata(tmp_path, alignment):
    path = str(tmp_path / "m.gguf")
    w = GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"] * 50)   # strings of every length
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_uint32("llama.block_count", 2)
    w.add_float64("x.f64", 1.5)
    w.add_bool("x.flag", True)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    # Q4_1 rows of 2 blocks: raw bytes [rows, 2 * 20], logical shape (rows, 64)
    raw = rng.integers(0, 256, size=(6, 40), dtype=np.uint8)
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = {t.name: t for t in read_tensors(path)}
    theirs = {t.name: t for t in GGUFReader(path).tensors}
    assert ours.keys() == theirs.keys() == {"token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"}
    for name, t in theirs.items():
        assert ours[name].type == t.tensor_type
        assert ours[name].shape == tuple(int(d) for d in t.shape)
        assert np.array_equal(np.asarray(ours[name].data).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert ours["blk.0.attn_q.weight"].shape == (64, 6)            # GGUF order: (in, out)
    assert np.array_equal(ours["blk.0.attn_q.weight"].data, raw)   # one row of bytes per output


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_tensors(str(path))
