"""A volunteer's peer in its own process, as ``kit.join`` starts it, without the training:
``python -m tests.auth.volunteer_process COORDINATOR_URL HF_TOKEN WORK_DIR``.

It fetches the run from the coordinator, logs in with the Hugging Face token (``Volunteer.login``:
the access token, the authorizer with the run's ``access.check_seconds``), starts its DHT peer
listening on 127.0.0.1 like ``Volunteer.start`` does, prints its address, and serves until its
stdin closes. Besides the DHT it serves ``test/hold``: echoes messages until the stream ends, so
that a test can hold a stream open to it and see why it was closed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kit.dht import DHT
from kit.p2p.api import StreamAPI
from kit.volunteer import Volunteer

HOLD = "test/hold"
ROOT = Path(__file__).resolve().parents[2]


def start(join_url: str, hf_token: str, work_dir: Path) -> subprocess.Popen[str]:
    """This module in a process of its own (stdin and stdout piped: its address is its first
    line; closing stdin stops it), running this checkout's kit."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "tests.auth.volunteer_process", join_url, hf_token, str(work_dir)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def hold(stream: StreamAPI) -> None:
    while (message := await stream.receive_message(timeout=300)) is not None:
        await stream.send_message(message, timeout=30)


def main() -> int:
    url, hf_token, work_dir = sys.argv[1:4]
    volunteer = Volunteer(url, work_dir=work_dir, host="127.0.0.1", client_mode=False)
    volunteer.login(hf_token)
    peer_options = dict(
        identity=volunteer.identity(),
        run_id=volunteer.config.collaboration.run_id,
        config_hash=volunteer.info.config_hash,
        authorizer=volunteer.authorizer,
    )
    dht = DHT(
        initial_peers=list(volunteer.info.initial_peers),
        client_mode=False,
        host="127.0.0.1",
        peer_options=peer_options,
    )

    async def serve(_: object, node: object) -> None:
        node.peer.add_stream_handler(HOLD, hold)  # type: ignore[attr-defined]

    dht.run_coroutine(serve)
    print(dht.get_visible_maddrs()[0], flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    dht.shutdown()
    volunteer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
