"""``kit demo``: a whole collaboration on this machine, the kit's embedded default.

It writes a small corpus (``kit.data.synthetic``: pseudo-Bengali text generated locally, nothing
is downloaded), trains the run's tokenizer on it, starts a coordinator in this process (bootstrap
peer, dashboard, metrics, auxiliary peer, checkpoints; it serves the corpus as token shards, the
tokenizer and its kit) and three volunteer processes (``kit join``), each in an empty folder of
its own, that get all of it from the coordinator as remote volunteers do and train a tiny ALBERT
together on the CPU for about two minutes. It shows a progress
bar, prints the dashboard address, and ends with the loss at the start and at the end: exit code
0 when the volunteers took global steps together and, on a run of 20 global steps or more, the
loss went down (``judge``: a shorter run is too short to judge it, and says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kit.config import RunConfig

logger = logging.getLogger(__name__)

#: Documents in the generated corpus (a few MB; tokenizes in seconds).
DEMO_DOCUMENTS = 4_000
#: Token ids per served shard: the demo corpus becomes ~10 shards, so volunteers start apart.
DEMO_SHARD_TOKENS = 1 << 16
#: Seconds an overrunning volunteer gets to write its stacks before it is terminated.
STACKS_SECONDS = 1.0
#: Checkpoints the demo's coordinator keeps (every one of a demo's run: ~3 MB each).
DEMO_KEPT_CHECKPOINTS = 100


def write_corpus(folder: Path, documents: int = DEMO_DOCUMENTS, seed: int = 0) -> list[Path]:
    """Write the demo corpus as 4 text files of one document per line."""
    from kit.data.synthetic import SyntheticBengali

    folder.mkdir(parents=True, exist_ok=True)
    generator = SyntheticBengali(seed=seed, vocabulary_size=2_000)
    files = [folder / f"part-{index}.txt" for index in range(4)]
    handles = [file.open("w", encoding="utf-8") for file in files]
    try:
        for index in range(documents):
            handles[index % 4].write(generator.document().replace("\n", " ") + "\n")
    finally:
        for handle in handles:
            handle.close()
    return files


def prepare(work_dir: Path, *, documents: int = DEMO_DOCUMENTS) -> tuple[RunConfig, Path]:
    """Corpus, tokenizer and run.yaml of the demo in ``work_dir``; returns (config, tokenizer dir)."""
    from kit.data.tokenizer import save_tokenizer, train_tokenizer

    corpus = write_corpus(work_dir / "demo_corpus", documents)
    config = RunConfig.tiny_demo(data_files=[str(work_dir / "demo_corpus" / "*.txt")])
    tokenizer_dir = work_dir / "demo_tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        texts = (line for file in corpus for line in file.read_text("utf-8").splitlines())
        tokenizer = train_tokenizer(texts, config.tokenizer, total=documents)
        save_tokenizer(tokenizer, tokenizer_dir)
    config = dataclasses.replace(
        config,
        tokenizer=dataclasses.replace(config.tokenizer, output_dir=str(tokenizer_dir)),
        # An absolute folder: the coordinator takes a relative one from its state dir, so a
        # relative `--work-dir demo` would nest demo/coordinator/demo/coordinator/checkpoints.
        # Every checkpoint is kept: the evaluation notebook compares the first with the newest.
        checkpoint=dataclasses.replace(
            config.checkpoint,
            folder=str((work_dir / "coordinator" / "checkpoints").resolve()),
            keep_last=DEMO_KEPT_CHECKPOINTS,
        ),
    )
    config.to_file(work_dir / "run.yaml")
    return config, tokenizer_dir


LOSS_JUDGED_FROM = 20  # global steps before the demo judges whether the loss went down
LOSS_WINDOW = 3  # loss points averaged at each end of the curve for that judgement (fewer if short)


def run_demo(
    work_dir: Path, *, peers: int = 3, duration: float = 120.0, documents: int = DEMO_DOCUMENTS
) -> dict[str, Any]:
    """Run the local collaboration; returns the figures it printed (losses, steps, peers)."""
    from kit.coordinator import Coordinator, CoordinatorOptions

    config, tokenizer_dir = prepare(work_dir, documents=documents)
    options = CoordinatorOptions(
        host="127.0.0.1",
        state_dir=str(work_dir / "coordinator"),
        tokenizer_dir=str(tokenizer_dir),
        metrics_period=2.0,
        shard_tokens=DEMO_SHARD_TOKENS,
    )
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    with Coordinator(config, options) as coordinator:
        print(f"kit demo: dashboard at {coordinator.dashboard_url}", flush=True)
        environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            for index in range(peers):
                peer_dir = work_dir / f"volunteer-{index}"
                peer_dir.mkdir(parents=True, exist_ok=True)
                log = (peer_dir / "log.txt").open("wb")
                logs.append(log)
                command = [
                    sys.executable, "-m", "kit", "--log-level", "WARNING", "join",
                    coordinator.join_url, "--host", "127.0.0.1", "--work-dir", str(peer_dir),
                    "--username", f"volunteer-{index}", "--max-seconds", str(duration),
                ]  # fmt: skip
                processes.append(  # in its empty folder: nothing of the organizer's at hand
                    subprocess.Popen(
                        command, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=peer_dir
                    )
                )
            _watch(coordinator, processes, duration)
        finally:
            stop_volunteers(processes)
            for log in logs:
                log.close()
        collector = coordinator.collector
        assert collector is not None  # started with the coordinator
        curve = collector.loss_curve()
        leaderboard = collector.leaderboard()
    losses = [point.loss for point in curve if point.loss is not None]
    result = {
        "global_steps": max((point.epoch for point in curve), default=0),
        "loss_start": losses[0] if losses else None,
        "loss_end": losses[-1] if losses else None,
        "losses": losses,
        "volunteers": [entry["username"] for entry in leaderboard],
        "exit_codes": [process.returncode for process in processes],
    }
    return result


def stop_volunteers(processes: list[subprocess.Popen[bytes]]) -> None:
    """End the volunteers that did not stop by themselves: each first writes its threads'
    stacks to its log.txt (``kit.volunteer.dump_stacks_on_signal``: where it was stuck), then gets
    SIGTERM, then SIGKILL after 30 s."""
    from kit.volunteer import STACKS_SIGNAL

    overrunning = [process for process in processes if process.poll() is None]
    for process in overrunning:
        logger.warning(
            "volunteer process %d did not stop by itself: its stacks go to its log.txt",
            process.pid,
        )
        if STACKS_SIGNAL is not None:
            process.send_signal(STACKS_SIGNAL)
    if overrunning and STACKS_SIGNAL is not None:
        time.sleep(STACKS_SECONDS)  # (faulthandler writes them from its signal handler)
    for process in overrunning:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _watch(coordinator: Any, processes: list[subprocess.Popen[bytes]], duration: float) -> None:
    """A progress bar over the demo's time, with the collaboration's step and loss."""
    started = time.monotonic()
    limit = duration + 90.0  # joining and leaving take time on a busy machine
    with tqdm(total=round(duration), desc="kit demo", unit="s") as bar:
        while time.monotonic() - started < limit:
            if all(process.poll() is not None for process in processes):
                break
            time.sleep(2.0)
            bar.n = min(round(duration), round(time.monotonic() - started))
            summary = coordinator.collector.summary()
            loss = summary.get("loss")
            bar.set_postfix(
                step=summary.get("global_epoch", 0),
                peers=summary.get("peers_online", 0),
                loss="n/a" if loss is None else f"{loss:.3f}",
                refresh=False,  # one redraw per tick (refresh below), not two lines per tick
            )
            bar.refresh()


def add_command(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="a coordinator and 3 volunteers training a tiny ALBERT here (~2 min)"
    )
    parser.add_argument("--peers", type=int, default=3, help="volunteer processes (default 3)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of training")
    parser.add_argument(
        "--work-dir", default=None, help="keep the files here (default: a temp dir)"
    )
    parser.set_defaults(handler=_demo_command)


def _demo_command(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.duration <= 0:
        logger.error(
            "--peers must be >= 1 and --duration > 0 - help: e.g. --peers 3 --duration 120"
        )
        return 2
    if args.work_dir is None:
        with tempfile.TemporaryDirectory(prefix="kit-demo-") as folder:
            result = run_demo(Path(folder), peers=args.peers, duration=args.duration)
    else:
        result = run_demo(Path(args.work_dir), peers=args.peers, duration=args.duration)
    start, end = result["loss_start"], result["loss_end"]
    print(
        f"kit demo: {result['global_steps']} global steps by {len(result['volunteers'])} "
        f"volunteers; loss {start if start is None else round(start, 4)} -> "
        f"{end if end is None else round(end, 4)}",
        flush=True,
    )
    problem, verdict = judge(result)
    if problem:
        logger.error("%s - help: see the volunteers' log.txt files", verdict)
        return 1
    print(f"kit demo: {verdict}", flush=True)
    return 0


def judge(result: dict[str, Any]) -> tuple[bool, str]:
    """Whether the demo failed, and why or what it showed (``run_demo``'s figures).

    The collaboration must take global steps with every volunteer exiting cleanly. Whether the
    loss went down is judged only on runs of at least ``LOSS_JUDGED_FROM`` global steps, from
    the mean of the first and last ``LOSS_WINDOW`` losses: over a few steps of a tiny model the
    loss may rise by chance (a 20 s run with two volunteers took 4 steps), and one noisy point at
    either end must not decide.
    """
    steps, losses = result["global_steps"], result.get("losses") or []
    failed = [code for code in result["exit_codes"] if code != 0]
    if failed:
        return True, f"{len(failed)} volunteer(s) exited with an error ({failed})"
    if steps < 1 or not losses:
        return True, "the collaboration took no global step"
    if steps < LOSS_JUDGED_FROM:
        return False, (
            f"{steps} global steps together; too few to judge the loss (it is judged from "
            f"{LOSS_JUDGED_FROM} steps: run longer, e.g. --duration 120)"
        )
    # The dashboard's curve has a point per collection, not per step: average what there is.
    window = min(LOSS_WINDOW, len(losses) // 2)
    if window == 0:
        return False, f"{steps} global steps together; the loss was seen once only"
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    if not last < first:
        return True, (
            f"the loss did not go down over {steps} global steps (mean of the first "
            f"{window} points: {first:.4f}, of the last {window}: {last:.4f})"
        )
    return False, f"the loss went down over {steps} global steps ({first:.4f} -> {last:.4f})"
