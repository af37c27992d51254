"""The one way every entry point builds a `host.module.Module`: with its certificate-backed
lane policy.

`synapse serve`, `python -m service`, the Ray Serve replica, the CLI commands, `synapse
certify`, `synapse batch embed` and its Ray Data actors all call `build_module`, so a model
is served on the same lane whichever of them runs it: a Core ML lane whose certificate is
certified for this machine, else llama.cpp (see certification.lane_policy). A Module built
without this (`Module(config)`) consults no certificates and serves everything on llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

from certification.lane_policy import CertificateLanePolicy
from certification.store import CertificateStore
from host.module import Module, ModuleConfig
from host.residency import ResidencyConfig
from ingest.store import default_root


def certificate_store(config: ModuleConfig) -> CertificateStore:
    """The certificates of a Module built with `config`: beside its artifact store
    (`<cache dir>/models` -> `<cache dir>/certificates`), where `synapse certify` saves them."""
    models = Path(config.store_root) if config.store_root is not None else default_root()
    return CertificateStore(models.parent / "certificates")


def build_module(
    config: ModuleConfig | None = None, residency: ResidencyConfig | None = None
) -> Module:
    """A Module for `config` (default: `ModuleConfig()`) whose calls without `lane=` are
    served by the lane its certificates choose."""
    config = config or ModuleConfig()
    policy = CertificateLanePolicy(certificate_store(config))
    return Module(config, policy, residency)
