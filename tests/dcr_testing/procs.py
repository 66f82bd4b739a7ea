"""Start a group of worker processes for the multi-process tests and wait for them, with a
deadline so a hang fails the test instead of blocking CI."""
import json
import multiprocessing
import os
import socket
import time
import traceback

# What the fork server imports once, before it forks any rank: everything any multi-process test's
# ranks need. There is one fork server per test session and only the first launch starts it (later
# preload lists are ignored), so a per-test list would leave later tests' ranks importing their
# frameworks themselves (megatron.core: seconds per rank). Modules that are not installed are
# skipped by the server.
PRELOAD = (
    "torch", "torch.distributed", "boto3",
    "nemo_dcr.state.statedigest", "nemo_dcr.stores", "nemo_dcr.sync.publisher", "nemo_dcr.sync.follower",
    "lightning.pytorch", "nemo_dcr.integrations.publish", "nemo_dcr.integrations.rollout",
    "megatron.core.parallel_state", "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed", "nemo_dcr.integrations.megatron", "nemo_dcr.integrations.hf_mapping",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target, world: int, make_args, out, deadline: float, preload=()):
    """Run ``target(*make_args(rank, port))`` in ``world`` processes forked from a fork server
    that has imported PRELOAD (and ``preload``) once (``spawn`` would import torch in every
    process: most of the run time on 2 cores; Python 3.11's fork server only preloads installed
    modules). Each worker writes ``out/<rank>.json``.
    -> ({rank: result}, {rank: exit code}, [hung ranks])."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD) + [m for m in preload if m not in PRELOAD])  # used by the first launch
    port = free_port()
    procs = [ctx.Process(target=target, args=make_args(r, port), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = {r: json.loads((out / f"{r}.json").read_text()) for r in range(world) if (out / f"{r}.json").exists()}
    return results, {r: p.exitcode for r, p in enumerate(procs)}, hung


def run_scenario(main, world: int, spec: dict, scenario: str, tmp_path, deadline: float, preload=()) -> dict:
    """``main(rank, world, port, spec, scenario, out)`` on ``world`` ranks (see :func:`launch`);
    fails the test on a hang or any rank's failure (with its traceback). -> {rank: result}."""
    out = tmp_path / f"out-{scenario}-{time.monotonic_ns()}"
    out.mkdir()
    results, codes, hung = launch(main, world, lambda r, port: (r, world, port, spec, scenario, str(out)), out,
                                  deadline, preload=preload)
    assert not hung, f"ranks {hung} of {scenario!r} still running after {deadline}s; exit codes {codes}"
    failed = {r: res.get("traceback") for r, res in results.items() if not res["ok"]}
    assert len(results) == world and not failed, f"{scenario}: {failed or codes}"
    return results


def run_rank(rank: int, world: int, port: int, out: str, body, timeout, prepare=None) -> None:
    """A rank's whole life: join the gloo group (``prepare()`` first, if given; ``port=None``:
    ``body`` joins it itself, as a framework's strategy does), run ``body(res)`` and write
    ``res`` (``ok``, ``seconds``, or the ``traceback``) to ``out/<rank>.json``; then leave the
    group together, or at once after a failure (a peer
    may be stuck in a collective: tearing the group down could block)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {"rank": rank, "ok": False}
    t0 = time.monotonic()
    try:
        if prepare is not None:
            prepare()
        if port is not None:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timeout)
        body(res)
        res["ok"] = True
    except BaseException:
        res["traceback"] = traceback.format_exc()
    res["seconds"] = time.monotonic() - t0
    tmp = os.path.join(out, f"{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, os.path.join(out, f"{rank}.json"))
    if res["ok"] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    elif not res["ok"]:
        os._exit(0)
