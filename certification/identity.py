"""What a certificate is about: the lane's identity, and the key certificates are stored under.

A certificate vouches for numbers, and numbers change with any of: the artifact bytes, the
owned-graph manifest and kernel revision (Core ML), the heads on the token states loaded
beside the artifact (their own files and digests), the compiled shapes, the engine build and
version, the device it runs on (CPU, Metal...), the runtime settings LOAD was given (Core
ML compute units, llama.cpp options such as flash_attn), the host tokenizer library, and the
OS (Core ML's ANE compiler ships with macOS). Equivalent spellings key the same: shapes are
sorted and a packed shape's unnamed segment count is resolved as the worker resolves it.
All of them are in `CertificateKey`; its digest is the certificate id, so a change to any one
of them means "no certificate" rather than a stale one.
"""

from __future__ import annotations

import hashlib
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from workers.ane import apple_device
from workers.ane.config import default_max_segments


class LaneIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The lane-side identity: from HELLO, the artifact store and the admitted shapes."""

    model: str
    lane: str  # "llama" | "ane"
    precision: str  # "f16" / "f32" (GGUF dtype) or "fp16" (Core ML graph)
    artifact_digest: str
    manifest_digest: str | None = None
    kernel_revision: str | None = None
    shapes: tuple[str, ...] = ()
    engine: str = ""
    engine_version: str = ""
    build_flags: str = ""
    # Test-only graph degradations (Core ML build_options) as canonical JSON: they change
    # the graph without changing HELLO, so they must be in the key themselves.
    build_options: str = ""
    # Where the lane computes ("cpu", "metal", "ane"...): a certificate earned on the CPU must
    # never cover a Metal lane, their numerics differ.
    device: str = ""
    # LOAD's runtime settings beyond shapes/build_options, as canonical JSON (see lane_client).
    settings: str = ""
    # The heads on the token states (sparse, multi-vector) the lane loads beside the artifact,
    # {kind: digest} as canonical JSON: their files are not in the artifact's digest, and a
    # re-ingested head changes the numbers of its output.
    heads: str = ""

    @classmethod
    def from_mapping(cls, model: str, lane: str, d: dict[str, Any]) -> LaneIdentity:
        """Normalize `Module.lane_identity()`'s dict (engine as a str or a HELLO-style dict)."""
        engine = d.get("engine", "")
        if isinstance(engine, dict):
            eng_name = str(engine.get("engine", ""))
            eng_version = str(engine.get("version", d.get("engine_version", "")))
            flags = str(engine.get("build_flags", d.get("build_flags", "")))
        else:
            eng_name = str(engine)
            eng_version = str(d.get("engine_version", ""))
            flags = str(d.get("build_flags", ""))
        return cls(
            model=model,
            lane=lane,
            precision=str(d.get("precision") or ("fp16" if lane == "ane" else "")),
            artifact_digest=str(d.get("artifact_digest") or d.get("digest") or ""),
            manifest_digest=d.get("manifest_digest"),
            kernel_revision=d.get("kernel_revision"),
            shapes=tuple(sorted(_shape_str(s) for s in d.get("shapes") or ())),
            engine=eng_name,
            engine_version=eng_version,
            build_flags=flags,
            build_options=canonical_json(d.get("build_options")),
            device=str(d.get("device") or ""),
            settings=canonical_json(d.get("settings")),
            heads=canonical_json(d.get("heads")),
        )


class CertificateKey(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    lane: str
    precision: str
    artifact_digest: str
    manifest_digest: str | None
    kernel_revision: str | None
    shapes: tuple[str, ...]
    engine: str
    engine_version: str
    build_flags: str
    build_options: str
    runtime: dict[str, str]  # host-side libraries that change what the lane receives
    os: str
    device: str = ""  # after the defaults-free fields; "" in certificates older than it
    settings: str = ""  # LOAD's runtime settings (canonical JSON); "" in older certificates
    heads: str = ""  # the token heads' digests (canonical JSON); "" without heads

    @property
    def id(self) -> str:
        """16 hex digits of sha256 over the canonical JSON of every field; `heads` only when
        there are heads, so a model without them keeps the id it had before the field."""
        fields = msgspec.to_builtins(self, order="sorted")
        if not self.heads:
            del fields["heads"]
        blob = msgspec.json.encode(fields)
        return hashlib.sha256(blob).hexdigest()[:16]

    def differences(self, other: CertificateKey) -> list[str]:
        """`field: old -> new` for every field that differs (for the policy's message)."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(other, name), getattr(self, name)
            if a != b:
                out.append(f"{name}: {_short(a)} -> {_short(b)}")
        return out


def key_for(identity: LaneIdentity) -> CertificateKey:
    return CertificateKey(
        model=identity.model,
        lane=identity.lane,
        precision=identity.precision,
        artifact_digest=identity.artifact_digest,
        manifest_digest=identity.manifest_digest,
        kernel_revision=identity.kernel_revision,
        shapes=identity.shapes,
        engine=identity.engine,
        engine_version=identity.engine_version,
        build_flags=identity.build_flags,
        build_options=identity.build_options,
        runtime=runtime_versions(),
        os=os_name(),
        device=identity.device,
        settings=identity.settings,
        heads=identity.heads,
    )


def runtime_versions() -> dict[str, str]:
    # Tokenization is module-side: a tokenizers upgrade changes the ids every lane receives.
    return {"tokenizers": _version("tokenizers")}


def os_name() -> str:
    """OS and architecture; on macOS also the version, the build and the chip: the Neural
    Engine compiler ships with the OS build, and chips differ in what their Neural Engine
    runs. Linux kernel releases do not change the numbers, so they are left out on purpose."""
    return os_identity(platform.system(), platform.machine(), apple_device.describe())


def os_identity(system: str, machine: str, apple: dict) -> str:
    """The certificate's `os` field from `apple_device.describe()`'s answers."""
    if system == "Darwin":
        chip = (apple.get("chip") or "unknown-chip").replace(" ", "_")
        return (
            f"macOS-{apple.get('macos') or '?'}-{apple.get('macos_build') or '?'}-{machine}-{chip}"
        )
    return f"{system}-{machine}"


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "absent"


def _shape_str(shape: object) -> str:
    if isinstance(shape, str):
        return shape
    if isinstance(shape, dict):
        rows, seq = shape.get("rows"), shape.get("seq_len")
        if not shape.get("packed"):
            return f"{rows}x{seq}"
        segs = shape.get("max_segments") or default_max_segments(int(seq or 0))
        return f"{rows}x{seq}p/{segs}"
    return str(shape)


def canonical_json(value: object) -> str:
    if not value:
        return ""
    return msgspec.json.encode(msgspec.to_builtins(value, order="sorted")).decode()


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
