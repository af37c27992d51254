"""Rewrite a GGUF with some metadata changed or tensors dropped or added: how tests make the
GGUFs that other converters write (no pooling type for rerankers, a dropped pooler, other
normalizer options, llama.cpp's two-row Qwen3 reranker head) from the ones ours writes.
f16/f32 tensors only."""

from __future__ import annotations

from pathlib import Path

import gguf

_INTERNAL = ("GGUF.", "general.architecture")


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    set_kv: dict | None = None,
    drop_kv: tuple = (),
    drop_tensors: tuple = (),
    arch: str | None = None,
    replace_tensors: dict | None = None,
    add_tensors: dict | None = None,
) -> Path:
    reader = gguf.GGUFReader(str(src))
    old_arch = str(reader.fields["general.architecture"].contents())
    arch = arch or old_arch
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith(_INTERNAL) or name in drop_kv or name in (set_kv or {}):
            continue
        new_name = arch + name[len(old_arch) :] if name.startswith(old_arch + ".") else name
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(new_name, field.contents(), field.types[0], sub)
    for name, (value, vtype, *sub) in (set_kv or {}).items():  # (value, type[, item type])
        writer.add_key_value(name, value, vtype, sub[0] if sub else None)
    for t in reader.tensors:
        if t.name not in drop_tensors:
            writer.add_tensor(t.name, (replace_tensors or {}).get(t.name, t.data))
    for name, data in (add_tensors or {}).items():  # HF (out, in) order, as the converters'
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
