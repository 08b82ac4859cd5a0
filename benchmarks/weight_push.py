"""Asynchronous RL's weight push (prorl/async_rl/push.py): bytes and time per push to a rollout.

    python -m benchmarks weight_push [--sizes 0.5B,1.5B,7B] [--max-gib 0.5] [--reps 3] [--quick]

Two processes on this host, a TCPStore and a gloo group, the code the run uses: trainer rank 0's
`WeightPusher.stage` (bf16 tensors into the preallocated host buckets) and its thread's signed
header and bucket broadcasts, the rollout rank's `WeightReceiver.receive` (header checks, buckets,
load into the model copy, the checksum check). Sizes are Qwen2.5's parameter counts in bf16; a size
over `--max-gib` is measured at `--max-gib` and projected linearly (rows `projected`, noted).
Rows (benchmarks/results/weight_push.csv, provider gloo-cpu, shape = the size): `stage_s` (what the
trainer's step pays), `push_s` (stage start to loaded on the rollout rank), `bytes` (GB per push),
`rate` (GB/s), and `link_s`: the bytes at a 25 GbE line rate (3.125 GB/s; a projection, no NCCL
path is measured here).
"""

from __future__ import annotations

import datetime
import multiprocessing
import time

import torch
import torch.distributed as dist

from benchmarks import harness

NAME = "weight_push"
PARAMS = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "7B": 7_615_616_512}
TENSOR = 16 * 2**20  # elements per tensor of the stand-in model (32 MiB in bf16)
LINK_BYTES_S = 25e9 / 8  # 25 GbE


def _named(numel: int, fill: float) -> list[tuple[str, torch.Tensor]]:
    sizes = [TENSOR] * (numel // TENSOR) + ([numel % TENSOR] if numel % TENSOR else [])
    return [(f"w{i}", torch.full((n,), fill, dtype=torch.bfloat16)) for i, n in enumerate(sizes)]


def _rollout(port: int, numel: int, reps: int, out) -> None:
    from prorl.async_rl.push import WeightReceiver

    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=600))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("push/", store), 1, 2, datetime.timedelta(600))
    model = torch.nn.Module()
    for name, t in _named(numel, 0.0):
        model.register_buffer(name, torch.zeros_like(t))
    receiver = WeightReceiver(store, pg, model, b"k" * 32, startup_s=600.0)
    store.set("ready", "1")
    done = []
    for i in range(reps):
        receiver.receive()
        done.append(time.time())
        store.set(f"loaded/{i}", "1")
    out.put(done)


def measure(numel: int, reps: int) -> dict[str, list[float]]:
    """Seconds of `reps` pushes of `numel` bf16 elements: stage and stage-to-loaded."""
    from prorl.async_rl import transport
    from prorl.async_rl.push import WeightPusher

    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(600), wait_for_workers=False
    )
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_rollout, args=(store.port, numel, reps, out), daemon=True)
    child.start()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("push/", store), 0, 2, datetime.timedelta(600))
    pusher = WeightPusher(store, pg, b"k" * 32)
    store.wait(["ready"])  # the rollout side's model allocated: its load is timed, not its start
    stage, starts = [], []
    for v in range(reps):
        named = _named(numel, float(v + 1))
        value = transport.checksum([t for _, t in named])  # every trainer's record
        starts.append(time.time())
        pusher.stage(v, iter(named), checksum_of=lambda value=value: value)
        stage.append(time.time() - starts[-1])
        while not store.check([f"loaded/{v}"]):  # one push at a time: each timed alone
            time.sleep(0.001)
            if not child.is_alive():
                raise RuntimeError("the rollout process died")
    done = out.get(timeout=600)
    pusher.close()
    child.join(60)
    return {"stage_s": stage, "push_s": [d - s for d, s in zip(done, starts)]}


def main(argv=None) -> int:
    ap = harness.argparser(NAME, __doc__)
    ap.add_argument("--sizes", default="0.5B,1.5B,7B")
    ap.add_argument("--max-gib", type=float, default=0.5, help="largest push measured (GiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one 8 MiB push (a smoke test)")
    ap.add_argument("--out", default=str(harness.RESULTS_DIR / f"{NAME}.csv"))
    args = ap.parse_args(argv)
    sizes = {"quick": 4 * 2**20} if args.quick else {s: PARAMS[s] for s in args.sizes.split(",")}
    cap = int(args.max_gib * 2**30 / 2) if not args.quick else 4 * 2**20
    rows = []
    for name, numel in sizes.items():
        measured = min(numel, cap)
        times = measure(measured, 2 if args.quick else args.reps + 1)
        times = {k: v[1:] for k, v in times.items()}  # the first push allocates the buckets
        scale = numel / measured
        note = "" if scale == 1 else f"measured at {measured * 2 / 2**30:.2f} GiB, x{scale:.1f}"
        case = dict(provider="gloo-cpu", mode="push", shape=name)
        for metric, values in times.items():
            r = harness.row(metric, "s", [v * scale for v in values], **case)
            rows.append(dict(r, mode="projected" if scale != 1 else "push", note=note))
        gb = numel * 2 / 1e9
        rows.append(dict(harness.row("bytes", "GB", [gb]), **case))
        rate = harness.rate_row(rows[-2], gb, "rate", "GB/s", seconds_per_unit=1.0)
        rows.append(dict(rate, note=note))
        link = dict(harness.row("link_s", "s", [gb * 1e9 / LINK_BYTES_S]), **case)
        rows.append(dict(link, mode="projected", note="25 GbE line rate"))
    out = None if args.quick else args.out
    harness.record(NAME, rows, out, device="cpu", versions=harness.versions_string())
    for r in rows:
        print(f"{r['shape']:>6} {r['mode']:<9} {r['metric']:<8} {r['p50']:10.3f} {r['unit']:<5} "
              f"{r.get('note', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
