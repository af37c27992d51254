"""Full disks, for real: a tmpfs of a few MB (tests/small_disk.py) under the artifact store and
under a batch job's output.

The rule under test: a write that does not fit is a typed `storage_full` error that says what
to free, nothing the store or the checkpoint had is lost or corrupted, nothing partial is left
taking space, and once space is freed the same command completes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests import small_disk
from tests.batch_support import batch_cli, read_output, write_jsonl

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(small_disk.unavailable() is not None, reason=str(small_disk.unavailable())),
]


@pytest.fixture
def disk():
    """An empty mount point, short and outside pytest's tmp dirs (the tmpfs hides it)."""
    with tempfile.TemporaryDirectory(prefix="disk-", dir="/tmp") as d:
        yield Path(d)


def _python(disk: Path, size: str, code: str, env: dict | None = None) -> dict:
    """Run `code` on a `size` disk at `disk`; it prints one JSON object, returned."""
    proc = small_disk.run_on_small_disk(disk, size, f"$PY - <<'PY'\n{code}\nPY\n", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_STORE_STATE = """
def state(store):
    names = [r.name for r in store.ls()]
    return {"ls": names, "entries": sorted(os.listdir(store.root)),
            "verified": [store.verify(n).name for n in names]}
"""


def test_a_build_the_disk_cannot_hold_is_refused_before_it_writes(disk):
    # 100 MB: the f16 MiniLM (~45 MB) fits, the f32 one (~87 MB) then does not.
    out = _python(
        disk,
        "100M",
        f"""
import json, os
from ingest import ArtifactStore
from common.errors import StorageFull
{_STORE_STATE}
store = ArtifactStore(os.environ["DISK"] + "/models")
try:
    store.ingest_default()
    err = None
except StorageFull as e:
    err = {{"code": e.code, "msg": e.message}}
print(json.dumps({{"err": err, "free": __import__("shutil").disk_usage(store.root).free,
                  **state(store)}}))
""",
    )
    assert out["err"]["code"] == "storage_full"
    assert "'minilm-l6-v2-f32' needs about 9" in out["err"]["msg"]
    assert "MiB are free; free some space and ingest again" in out["err"]["msg"]
    # What was published stays whole and verifiable; the refused build wrote nothing.
    assert out["ls"] == out["verified"] == ["minilm-l6-v2-f16"]
    assert out["entries"] == [".lock", "minilm-l6-v2-f16"]
    assert out["free"] > 50 * 2**20


def test_gemma_with_its_derived_tokenizer_is_sized_as_a_whole(disk):
    # 400 MB: MiniLM (~134 MiB) fits and leaves ~266 MiB, room for Gemma's GGUF (241 MiB) but
    # not for it and the tokenizer derived from it (+32 MiB): refused before either is written.
    out = _python(
        disk,
        "400M",
        f"""
import json, os
from ingest import ArtifactStore
from common.errors import StorageFull
from ingest.gguf_vocab import write_tokenizer_json
{_STORE_STATE}
store = ArtifactStore(os.environ["DISK"] + "/models")
try:
    store.ingest_default(tokenizer_builder=write_tokenizer_json)
    err = None
except StorageFull as e:
    err = {{"code": e.code, "msg": e.message}}
print(json.dumps({{"err": err, **state(store)}}))
""",
    )
    assert out["err"]["code"] == "storage_full", out
    assert "'gemma3-270m' needs about 273" in out["err"]["msg"], out
    assert out["entries"] == [".lock", "minilm-l6-v2", "minilm-l6-v2-f16", "minilm-l6-v2-f32"]


def test_a_disk_that_fills_during_a_build_keeps_nothing_of_it_and_the_store_recovers(disk):
    # Another writer takes the space once the build has started: the conversion's write then
    # fails midway (numpy's short write carries no errno; the free space decides).
    out = _python(
        disk,
        "100M",
        f"""
import json, os
from ingest.model_packages import minilm_dir
from ingest import ArtifactStore
from common.errors import StorageFull
from tests.small_disk import fill_disk_when
{_STORE_STATE}
store = ArtifactStore(os.environ["DISK"] + "/models")
thread = fill_disk_when(os.environ["DISK"], lambda: any(
    p.name.startswith(".tmp-") for p in store.root.iterdir()))
try:
    store.ingest_hf_dir(minilm_dir(), name="mini", dtype="f16")
    err = None
except StorageFull as e:
    err = {{"code": e.code, "msg": e.message, "cause": repr(e.__cause__)}}
thread.join()
full = state(store)
os.remove(os.environ["DISK"] + "/filler")
store.ingest_hf_dir(minilm_dir(), name="mini", dtype="f16")
print(json.dumps({{"err": err, "full": full, "after": state(store)}}))
""",
    )
    assert out["err"] is not None, "the build fitted before the other writer took the space"
    assert out["err"]["code"] == "storage_full", out["err"]
    assert "filled up while building 'mini'" in out["err"]["msg"]
    assert "nothing of it was kept" in out["err"]["msg"]
    assert out["full"] == {"ls": [], "entries": [".lock"], "verified": []}
    assert out["after"]["ls"] == out["after"]["verified"] == ["mini"]
    assert out["after"]["entries"] == [".lock", "mini"]


# A script prefix: MiniLM installed as "mini" on the small disk, and `attempt(attach)`, which
# runs attach() and returns its StorageFull and the model's state after it.
_MINI_TOKENIZER = f"""
import hashlib, json, os
from pathlib import Path
from ingest.model_packages import minilm_dir
from ingest import ArtifactStore
from common.errors import StorageFull
from tests.small_disk import fill_disk
{_STORE_STATE}
d = Path(os.environ["DISK"])
store = ArtifactStore(d / "models")
rec = store.ingest_hf_dir(minilm_dir(), name="mini", dtype="f16")
before = hashlib.sha256(rec.tokenizer_path.read_bytes()).hexdigest()
def attempt(attach):
    try:
        attach()
        err = None
    except StorageFull as e:
        err = {{"code": e.code, "msg": e.message}}
    mini = store.get("mini")
    after = hashlib.sha256(mini.tokenizer_path.read_bytes()).hexdigest()
    leftovers = sorted(p.name for p in mini.dir.iterdir() if p.name.endswith(".tmp"))
    return {{"err": err, "full": state(store), "same": before == after, "leftovers": leftovers}}
"""


def test_a_tokenizer_that_does_not_fit_leaves_the_model_as_it_was(disk, tmp_path):
    from ingest.model_packages import minilm_dir

    # A bigger tokenizer.json (the same tokenizer, indented), attached onto a full disk.
    bigger = tmp_path / "tokenizer.json"
    bigger.write_text(
        json.dumps(json.loads((minilm_dir() / "tokenizer.json").read_text()), indent=4)
    )
    out = _python(
        disk,
        "60M",
        _MINI_TOKENIZER
        + f"""
bigger = Path({str(bigger)!r})
filler = fill_disk(d)
out = attempt(lambda: store.attach_tokenizer("mini", bigger))
filler.unlink()
store.attach_tokenizer("mini", bigger)
out["attached"] = store.get("mini").tokenizer_path.stat().st_size
print(json.dumps(out))
""",
    )
    assert out["err"]["code"] == "storage_full", out
    assert "needs about" in out["err"]["msg"]  # refused before it wrote
    assert "the model is as it was" in out["err"]["msg"]
    assert out["full"]["ls"] == out["full"]["verified"] == ["mini"]
    assert out["same"] and out["leftovers"] == []
    assert out["attached"] > 0


def test_a_tokenizer_write_the_disk_fills_during_leaves_the_model_as_it_was(disk):
    # The space was there when the write began; another writer takes it midway.
    out = _python(
        disk,
        "60M",
        _MINI_TOKENIZER
        + """
def write(tmp):
    with open(tmp, "wb") as f:
        f.write(b"{" + b" " * 4096)
        f.flush()
        fill_disk(d)
        f.write(b" " * (1 << 20))
        f.flush()
        os.fsync(f.fileno())
mini = store.get("mini")
print(json.dumps(attempt(lambda: store._replace_tokenizer(mini, write, need_bytes=1 << 20))))
""",
    )
    assert out["err"]["code"] == "storage_full", out
    assert "no space left" in out["err"]["msg"] and "the model is as it was" in out["err"]["msg"]
    assert out["full"]["ls"] == out["full"]["verified"] == ["mini"]
    assert out["same"] and out["leftovers"] == []


def test_a_short_write_without_errno_is_a_full_disk_only_when_space_is_short(disk):
    # numpy's tofile (the GGUF writer's tensor writes) reports a full disk as a bare OSError
    # "N requested and M written": no errno, so the free space has to decide.
    out = _python(
        disk,
        "1M",
        """
import errno, json, os
from pathlib import Path
import numpy as np
from ingest.durable import ran_out_of_space
d = Path(os.environ["DISK"])
try:
    with open(d / "big", "wb") as f:
        np.zeros(1 << 20, np.float32).tofile(f)  # 4 MB onto 1 MB
    exc = None
except OSError as e:
    exc = e
(d / "big").unlink()
print(json.dumps({"errno": exc.errno, "short": ran_out_of_space(exc, d, 4 << 20),
                  "unknown_need": ran_out_of_space(exc, d, 0),
                  "fits": ran_out_of_space(exc, d, 1024),
                  "not_space": ran_out_of_space(PermissionError(errno.EACCES, "no"), d, 4 << 20),
                  "enospc": ran_out_of_space(OSError(errno.ENOSPC, "full"), d)}))
""",
    )
    assert out == {
        "errno": None,
        "short": True,
        "unknown_need": False,
        "fits": False,
        "not_space": False,
        "enospc": True,
    }


def test_a_core_ml_shape_that_does_not_fit_leaves_the_compile_cache_as_it_was(disk):
    out = _python(
        disk,
        "30M",
        """
import json, os
from compile_cache import CompileCache
from compile_cache.errors import BuildFailed
from tests import test_ane_helpers as h
from workers.ane.backends import ReferenceBackend
from workers.ane.builder import BuildOptions
from workers.ane.compiler import admit
from workers.ane.shapes import Shape
root = os.environ["DISK"] + "/cc"
try:
    with CompileCache(root) as cache:
        admit(cache, h.minilm(), Shape(4, 64), ReferenceBackend(), BuildOptions(), None)
    err = None
except BuildFailed as e:
    err = {"code": e.code, "msg": str(e)}
with CompileCache(root) as cache:
    entries = len(cache.ls())
print(json.dumps({"err": err, "entries": entries, "objects": os.listdir(root + "/objects"),
                  "tmp": os.listdir(root + "/tmp")}))
""",
    )
    assert out["err"] is not None and out["err"]["code"] == "build_failed", out
    assert out["entries"] == 0 and out["objects"] == [] and out["tmp"] == []


def test_a_build_the_full_disk_stops_is_retried_after_evicting_the_oldest_entries(disk):
    # A 3 MiB disk holds three 700 KiB entries; a 1200 KiB build then hits ENOSPC with about
    # 890 KiB free. The cache evicts least-recently-used unleased entries until twice that is
    # free, and builds again. With nothing it may evict, the build fails typed, as before.
    out = _python(
        disk,
        "3M",
        """
import json, os
from compile_cache import CompileCache
from compile_cache.errors import BuildFailed
root = os.environ["DISK"] + "/cc"

def blob(kib):
    return lambda d: (d / "blob").write_bytes(b"x" * (kib << 10))

def names(cache):
    return sorted(e.key["k"] for e in cache.ls())

with CompileCache(root) as cache:
    for name in ("a", "b", "c"):
        cache.get_or_build({"k": name}, blob(700))
    with cache.lease({"k": "a"}):  # the least recently used, but leased: never evicted
        cache.get_or_build({"k": "d"}, blob(1200))
        after_room = names(cache)
        with cache.lease({"k": "d"}):
            try:
                cache.get_or_build({"k": "e"}, blob(1500))  # all leased: nothing to evict
                err = None
            except BuildFailed as e:
                err = e.code
        after_refusal = names(cache)
    tmp = os.listdir(root + "/tmp")
print(json.dumps({"after_room": after_room, "err": err, "after_refusal": after_refusal,
                  "tmp": tmp}))
""",
    )
    assert out["after_room"] == ["a", "d"], out
    assert out["err"] == "build_failed" and out["after_refusal"] == ["a", "d"], out
    assert out["tmp"] == [], out


def test_a_certificate_that_does_not_fit_leaves_the_previous_record_current(disk):
    out = _python(
        disk,
        "1M",
        """
import json, os
from pathlib import Path
from certification.store import CertificateStore
from common.errors import StorageFull
from tests.small_disk import fill_disk
from tests.test_certification_store import make_cert
store = CertificateStore(os.environ["DISK"] + "/certs")
old, new = make_cert("2026-01-01T00:00:01Z"), make_cert("2026-01-01T00:00:02Z", "failed")
store.save(old)
filler = fill_disk(os.environ["DISK"])
try:
    store.save(new)
    err = None
except StorageFull as e:
    err = {"code": e.code, "msg": e.message}
current = store.get(old.id)
leftovers = sorted(p.name for p in store.root.iterdir() if p.name.startswith(".tmp-"))
filler.unlink()
store.save(new)
print(json.dumps({"err": err, "current": [current.created_at, current.status],
                  "leftovers": leftovers, "after": store.get(old.id).status,
                  "history": len(list((store.root / "history" / old.id).iterdir()))}))
""",
    )
    assert out["err"]["code"] == "storage_full", out
    assert "the previous record is unchanged" in out["err"]["msg"]
    assert out["current"] == ["2026-01-01T00:00:01Z", "certified"]
    assert out["leftovers"] == []
    assert out["after"] == "failed" and out["history"] == 1


def test_a_core_ml_lane_whose_model_build_does_not_fit_is_storage_full(disk):
    # The store holds the f16 MiniLM (~45 MB) on 100 MB; the Core ML lane's owned build
    # (f32 weights, ~88 MB) then does not fit, and the load says so with its own code.
    out = _python(
        disk,
        "100M",
        """
import asyncio, json, os
from ingest.model_packages import minilm_dir
from host.config import HostConfig
from common.errors import StorageFull
from host.module import Module, ModuleConfig
from ingest import ArtifactStore
d = os.environ["DISK"]
ArtifactStore(d + "/models").ingest_hf_dir(minilm_dir(), name="mini", dtype="f16")

async def go():
    config = ModuleConfig(store_root=d + "/models", host=HostConfig(runtime_dir=d + "/rt"))
    async with Module(config) as mod:
        try:
            await mod.load("mini", lane="ane")
            return None
        except StorageFull as e:
            return {"code": e.code, "status": e.http_status, "msg": e.message,
                    "models": [[s.model, s.lane] for s in mod.served_lanes()]}

err = asyncio.run(go())
print(json.dumps({"err": err, "owned": sorted(os.listdir(d + "/owned"))}))
""",
    )
    assert out["err"] is not None, out
    assert (out["err"]["code"], out["err"]["status"]) == ("storage_full", 507)
    assert "the Core ML build of 'mini' needs about 9" in out["err"]["msg"]
    assert out["err"]["models"] == []
    assert [n for n in out["owned"] if not n.endswith(".lock")] == []


def test_a_core_ml_build_that_the_disk_fills_during_keeps_nothing(disk):
    out = _python(
        disk,
        "200M",
        """
import json, os
from pathlib import Path
from ingest.model_packages import minilm_dir
from ingest import ArtifactStore
from common.errors import StorageFull
from ingest.owned import ensure_owned, owned_dir
from tests.small_disk import fill_disk_when_dir_appears
d = Path(os.environ["DISK"])
store = ArtifactStore(d / "models")
record = store.ingest_hf_dir(minilm_dir(), name="mini", dtype="f16")
out = owned_dir(store, record)

out.parent.mkdir(parents=True, exist_ok=True)
# Once the build has its temp dir, another writer takes the rest of the disk.
filler = fill_disk_when_dir_appears(d, out.parent, f".{out.name}.")
try:
    ensure_owned(store, record)
    err = None
except StorageFull as e:
    err = {"code": e.code, "msg": e.message}
filler.wait(60)
left = sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".lock"))
(d / "filler").unlink()
built, digest = ensure_owned(store, record)
print(json.dumps({"err": err, "left": left, "built": built.name, "digest": len(digest)}))
""",
    )
    assert out["err"] is not None, "the build fitted before the other writer took the space"
    assert out["err"]["code"] == "storage_full"
    assert "filled up during the Core ML build of 'mini'" in out["err"]["msg"]
    assert out["left"] == []
    assert out["built"].startswith("mini-") and out["digest"] == 64


def test_models_ingest_on_a_full_disk_is_one_line_and_exit_2(disk):
    proc = small_disk.run_on_small_disk(
        disk,
        "20M",
        'export SYNAPSE_CACHE_DIR="$DISK/cache"\n'
        'MODEL=$("$PY" -c "from ingest.model_packages import minilm_dir; '
        'print(minilm_dir())")\n'
        '"$PY" -m cli.main models ingest "$MODEL" --name mini --dtype f16 || echo "rc=$?"\n'
        'ls -A "$SYNAPSE_CACHE_DIR/models"\n',
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rc=2" in proc.stdout
    assert proc.stderr.startswith("error[storage_full]: 'mini' needs about 4"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.split("rc=2", 1)[1].split() == [".lock"]


def test_a_batch_job_that_fills_its_disk_resumes_to_the_same_output(
    disk, synapse_cache_dir, tmp_path
):
    # 400 rows in windows of 128: each part is ~200 KB, so a 512 KB disk takes two commits
    # and the third window, still short of the end, finds it full.
    ids = write_jsonl(tmp_path / "in.jsonl", 400, seed=3)
    reference = tmp_path / "reference.parquet"
    done = batch_cli(
        synapse_cache_dir, str(tmp_path / "in.jsonl"), "-o", str(reference), "--window-rows", "128"
    )
    assert done.returncode == 0, done.stderr

    job = (
        f'"$PY" -m cli.main batch embed {tmp_path / "in.jsonl"} -o "$DISK/out.parquet" '
        "--window-rows 128"
    )
    proc = small_disk.run_on_small_disk(
        disk,
        "512K",
        f'{job} 2>{tmp_path / "first.err"} || echo "first rc=$?"\n'
        'echo "left: $(ls -A "$DISK/out.parquet.partial" | tr "\\n" " ")"\n'
        'echo "state: $(cat "$DISK/out.parquet.partial/state.json")"\n'
        "remount 8M\n"
        f'{job} --resume >/dev/null || echo "second rc=$?"\n'
        'echo "after: $(ls -A "$DISK" | tr "\\n" " ")"\n'
        f'cp "$DISK/out.parquet" {tmp_path / "resumed.parquet"}\n',
        env={"SYNAPSE_CACHE_DIR": str(synapse_cache_dir)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    first_err = (tmp_path / "first.err").read_text()
    assert "first rc=1" in proc.stdout, (proc.stdout, first_err)
    # Progress lines may come first (a slow machine prints one every few seconds); the abort
    # is the last word.
    assert first_err.splitlines()[-1].startswith(
        "synapse batch: aborted: no space left on the device of "
    ), first_err
    assert "keeps every committed row" in first_err and "--resume" in first_err
    assert "Traceback" not in first_err
    assert "second rc" not in proc.stdout, proc.stdout

    # The first run stopped at a commit boundary: only whole parts, no partial file.
    state = json.loads(lines["state"])
    assert state["parts"] >= 1 and state["rows"] == 128 * state["parts"] < len(ids)
    assert sorted(lines["left"].split()) == sorted(
        ["errors.jsonl", "state.json"] + [f"part-{i:06d}.parquet" for i in range(state["parts"])]
    )
    # The resumed run published the whole output and cleared its checkpoint.
    assert lines["after"].split() == ["out.parquet"]
    table, got_ids = read_output(tmp_path / "resumed.parquet")
    ref_table, ref_ids = read_output(reference)
    assert got_ids == ref_ids == ids
    np.testing.assert_array_equal(_vectors(table), _vectors(ref_table))


def _vectors(table) -> np.ndarray:
    return np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("ray", [False, True], ids=["local", "ray"])
def test_serve_on_a_full_disk_says_why_it_cannot_start(disk, ray):
    # --ray too: the defaults are installed before Ray starts, with the same line and code.
    proc = small_disk.run_on_small_disk(
        disk,
        "20M",
        'export SYNAPSE_CACHE_DIR="$DISK/cache"\n'
        "printf 'port = 0\\n' > \"$DISK/serve.toml\"\n"
        f'"$PY" -m cli.main serve --config "$DISK/serve.toml" {"--ray" if ray else ""}'
        ' || echo "rc=$?"\n'
        'ls -A "$SYNAPSE_CACHE_DIR/models"\n',
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "listening" not in proc.stdout and "rc=2" in proc.stdout
    assert proc.stderr.startswith(
        "synapse serve: cannot install the default models: error[storage_full]: "
        "'minilm-l6-v2-f16' needs about 4"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.split()[-1] == ".lock"
