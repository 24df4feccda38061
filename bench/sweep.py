"""A profiling sweep serially and on a local Ray cluster: the same cells, two fresh databases.

    serial     `service.profile` in this process (one torch thread, as a worker has), the pair loaded once
    ray        engine/service/sweeps/cluster_sweep.py on a local cluster of 2 CPUs, one worker per CPU (one thread
               each), every cell stored by this process as it comes back

Prints the wall time of each (with what starting costs apart), the overhead per cell (a worker's
time per cell beyond the run itself: dispatch, Arrow transfer, waiting for the driver), the
driver's DuckDB write time per cell (the single writer's ceiling in cells/s), and whether the
stored records are identical (engine/service/sweeps/cluster_sweep.py `records`: token ids, steps, acceptance; the wall
clock aside). docs/scale.md reads these figures.

Run: python bench/sweep.py [--tiny] [--json]   or   python -m engine bench sweep [--tiny] [--json]"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from engine.base.flags import add_model_args, exact_verify
from engine.base.helpers import csv_list
from engine.service import profile, prompt_set
from engine.service.sweeps.cluster import ClusterSpec, PairSpec, differences, records
from engine.service.sweeps.cluster_sweep import profile_on_ray
from engine.service.sweeps.serial import sweep_jobs
from store import Store


def tiny_pair_dirs(root: Path) -> tuple[str, str]:
    """The tests' tiny random pair (tests/tiny.py), made in `root`: a sweep of mechanics, fast."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import save_tiny_llama

    target = save_tiny_llama(root / "target", seed=0)
    draft = save_tiny_llama(root / "draft", seed=1, base=target, noise=0.15)
    return str(target), str(draft)


def run_wall_s(db: str, sweep: str) -> float:
    """Σ of the stored runs' own wall time: what the cells cost without any sweep machinery."""
    with Store(db, read_only=True) as st:
        return float(st.runs(sweep=sweep)["wall_ms"].sum()) / 1e3


def measure(pair: PairSpec, jobs: list, max_new_tokens: int, workers: int, root: Path) -> dict:
    """Both sweeps of `jobs` into fresh databases under `root`; the figures and the identity."""
    serial_db, ray_db = str(root / "serial.duckdb"), str(root / "ray.duckdb")
    t0 = time.monotonic()
    loaded = pair.load(jobs[0].tier)
    load_s = time.monotonic() - t0
    with Store(serial_db) as st:
        t1 = time.monotonic()
        profile(st, "bench", jobs, lambda tier: loaded if tier == jobs[0].tier else pair.load(tier), max_new_tokens)
        serial_sweep_s = time.monotonic() - t1
    loaded = None  # the serial pair goes before the workers load theirs
    with Store(ray_db) as st:
        res = profile_on_ray(st, "bench", jobs, pair, max_new_tokens, ClusterSpec(None, workers))
    n = len(jobs)
    ray_sweep_s = res.wall_s - res.start_s
    serial_runs_s, ray_runs_s = run_wall_s(serial_db, "bench"), run_wall_s(ray_db, "bench")
    with Store(serial_db, read_only=True) as a, Store(ray_db, read_only=True) as b:
        diff = differences(records(a, "bench"), records(b, "bench"))
    return dict(
        cells=n, workers=len(res.workers), failed=res.failed,
        serial_s=load_s + serial_sweep_s, serial_load_s=load_s, serial_sweep_s=serial_sweep_s,
        ray_s=res.wall_s, ray_start_s=res.start_s, ray_sweep_s=ray_sweep_s,
        speedup_sweep=serial_sweep_s / ray_sweep_s, speedup_total=(load_s + serial_sweep_s) / res.wall_s,
        serial_run_s_per_cell=serial_runs_s / n, ray_run_s_per_cell=ray_runs_s / n,
        serial_overhead_ms_per_cell=(serial_sweep_s - serial_runs_s) / n * 1e3,
        ray_overhead_ms_per_cell=(ray_sweep_s * len(res.workers) - ray_runs_s) / n * 1e3,
        store_ms_per_cell=res.store_s / n * 1e3, driver_cells_per_s_max=n / res.store_s if res.store_s else None,
        identical=not diff, differences=diff[:5],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench sweep", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random pair instead of --target/--draft")
    p.add_argument("--prompts", default="bench", help="prompt set: heldout, bench or train")
    p.add_argument("--per-task", type=int, default=1)
    p.add_argument("--policies", default="ar,fixed:2,fixed:4")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the serial sweep (default 1, a "
                   "worker's: CPU kernels split sums by thread, so another count moves signals' last bits)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    jobs = sweep_jobs(prompt_set(a.prompts, a.per_task), [a.target_tier], csv_list(a.policies))
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        root = Path(tmp)
        target, draft = tiny_pair_dirs(root) if a.tiny else (a.target, a.draft)
        pair = PairSpec(target, draft, a.draft_tier, a.device or ("cpu" if a.tiny else None), a.trust_remote_code,
                        exact_verify(a), a.eagle)
        res = measure(pair, jobs, a.max_new_tokens, a.workers, root)
    import torch

    res.update(pair="tiny test pair" if a.tiny else (a.target or "embedded"), tier=a.target_tier,
               max_new_tokens=a.max_new_tokens, serial_threads=torch.get_num_threads())
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"sweep of {res['cells']} cells ({res['pair']}, {a.target_tier}, {a.max_new_tokens} new tokens): serial "
          f"({res['serial_threads']} threads) vs Ray, {res['workers']} workers × 1 CPU on a local cluster")
    print(f"  serial  {res['serial_s']:7.1f} s = load {res['serial_load_s']:5.1f} + sweep {res['serial_sweep_s']:6.1f}"
          f"   run {res['serial_run_s_per_cell'] * 1e3:7.1f} ms/cell, overhead {res['serial_overhead_ms_per_cell']:6.1f} ms/cell")
    print(f"  ray     {res['ray_s']:7.1f} s = start {res['ray_start_s']:5.1f} + sweep {res['ray_sweep_s']:6.1f}"
          f"   run {res['ray_run_s_per_cell'] * 1e3:7.1f} ms/cell, overhead {res['ray_overhead_ms_per_cell']:6.1f} ms/cell "
          "(per worker)")
    print(f"  sweep speed-up {res['speedup_sweep']:.2f}× (with starting: {res['speedup_total']:.2f}×); driver writes "
          f"{res['store_ms_per_cell']:.1f} ms/cell (≤ {res['driver_cells_per_s_max']:.0f} cells/s from one writer)")
    print(f"  records identical (token ids, steps, acceptance; wall clock aside): {res['identical']}"
          + ("" if res["identical"] else f" — {'; '.join(res['differences'])}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
