"""What the Core ML lane's end-to-end family tests share: a directory ingested into a store of
the module's own and served through a real host Module on the reference executor."""

from __future__ import annotations

from pathlib import Path

import numpy as np


async def serve_on_ane(
    src: Path, name: str, module_tmp: Path, runtime_dir: str, shapes: list, texts: list[str]
) -> tuple[np.ndarray, dict, float, str]:
    """`src` ingested as `name` and served on the Core ML lane with `shapes` (those the
    module's engines compiled into `module_tmp / "cache"`: the same artifact digest, so cache
    hits): the query-prompted vectors of `texts`, the lane identity and the placement."""
    from host.config import HostConfig
    from host.module import Module, ModuleConfig
    from ingest.store import ArtifactStore

    store = ArtifactStore(module_tmp / "models")
    store.ingest_hf_dir(src, name, dtype="f32")
    config = ModuleConfig(
        store_root=str(store.root), host=HostConfig(runtime_dir=runtime_dir, ping_interval_s=0)
    )
    extra = {"backend": "reference", "cache_root": str(module_tmp / "cache"), "shapes": shapes}
    async with Module(config) as mod:
        await mod.load(name, "ane", extra)
        vectors = (await mod.embed(texts, model=name, lane="ane", prompt_name="query")).vectors
        identity = mod.lane_identity(name, "ane")
        share, source = await mod.placement(name, lane="ane")
    return np.asarray(vectors), identity, share, source


def load_reference_engine(manifest, runtime_config: dict):
    """An in-process Core ML engine on the reference executor with `manifest`'s owned
    artifact LOADed under `runtime_config` (cache root, shapes, heads...)."""
    from workers.ane.engine import AneEngine
    from workers.engine import NullProgress
    from workers.protocol import messages as m

    engine = AneEngine(manifest.dir, backend="reference")
    engine.load(
        m.LOAD(
            req_id=1,
            artifact_path=manifest.dir,
            artifact_digest=manifest.digest,
            format="coreml-owned",
            runtime_config=runtime_config,
        ),
        NullProgress(),
    )
    return engine
