"""The default model's conversion reads its GGUF file once (qmc_sampler.models)."""

import pytest

from qmc_sampler.models import _gguf_read_once

gguf = pytest.importorskip("gguf", reason="eval extra not installed")


def write_gguf(path, tensors: int) -> None:
    """A small llama GGUF file: a few metadata fields and ``tensors`` float32 tensors."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    for i in range(tensors):
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.full((4, 4), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_while_converting_each_file_is_parsed_once_and_each_name_map_built_once(tmp_path):
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(first, 2)
    write_gguf(second, 3)
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_read_once():
        reader = gguf.GGUFReader(first)
        # transformers asks again for the tokenizer, the config and the weights: the same reader each time
        assert gguf.GGUFReader(str(first)) is reader and gguf.GGUFReader(first, "r") is reader
        assert len(gguf.GGUFReader(second).tensors) == 3 and len(reader.tensors) == 2  # each file its own
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 3)
        assert gguf.get_tensor_name_map(arch, 2).get_name("blk.0.attn_q") == "blk.0.attn_q"
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map  # put back


def test_the_gguf_module_is_put_back_when_the_conversion_fails():
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(OSError), _gguf_read_once():
        raise OSError("disk full")
    assert gguf.GGUFReader is original_reader and gguf.get_tensor_name_map is original_map
