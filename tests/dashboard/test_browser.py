"""The dashboard in a real headless Chromium, against a live short run over real DHT nodes: the
loss curve, peers and samples/s over time, the leaderboard, human times, and the join cell."""

from __future__ import annotations

import asyncio
import functools
import html
import os
import re
import time
from pathlib import Path

import pytest

from kit.dashboard.routes import register_dashboard
from kit.dht.node import DHTNode
from kit.join_notebook import JOIN_NOTEBOOK_PATH, join_notebook_bytes
from kit.metrics.collector import MetricsCollector
from kit.metrics.reporter import MetricsReporter
from kit.p2p.peer import HttpRequest, HttpResponse, create_peer
from tests.conftest import MS
from tests.dht.swarm import Swarm

CHROMIUM = os.environ.get("KIT_TEST_CHROMIUM", "/usr/bin/chromium")
RUN = "browser-test"
EPOCHS = 6
XSS_NAME = "<img src=x onerror=\"document.title='pwned'\">"
LINK = "https://run.example.org"
WHEEL = LINK + "/install/kit_collab-9.9-py3-none-any.whl"
DIGEST = "ab" * 32
BROWSER_TIMEOUT = 120_000 * MS

pytestmark = [
    pytest.mark.sockets,
    pytest.mark.processes,
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)),
        reason=f"no Chromium at {CHROMIUM} (apt-get install chromium, or set KIT_TEST_CHROMIUM)",
    ),
]


async def dump_dom(url: str, profile: Path) -> str:
    """What Chromium renders at ``url`` after 8 s of virtual time (its scripts have run)."""
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-proxy-server",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        "--dump-dom",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        stdout, _ = await asyncio.wait_for(process.communicate(), BROWSER_TIMEOUT)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"Chromium did not finish within {BROWSER_TIMEOUT:.0f} s") from None
    assert process.returncode == 0, f"Chromium exited with {process.returncode}"
    return stdout.decode()


async def wait_for_epochs(collector: MetricsCollector, epochs: int) -> None:
    deadline = time.monotonic() + 30_000 * MS
    while len(collector.loss_curve()) < epochs:
        assert time.monotonic() < deadline, "the collector did not see every epoch"
        await asyncio.sleep(0.05)


@pytest.mark.async_timeout(240)
async def test_dashboard_renders_the_live_curve_and_leaderboard(tmp_path: Path) -> None:
    factory = functools.partial(create_peer, host="127.0.0.1", run_id=RUN, relay_service=True)
    async with Swarm(factory) as swarm:
        coordinator = await swarm.add_node()
        trainers: list[tuple[str, DHTNode, int]] = [
            ("alice", await swarm.add_node(), 48),  # samples per epoch
            ("bob", await swarm.add_node(client_mode=True), 16),
            (XSS_NAME, await swarm.add_node(), 32),
        ]
        reporters = []
        for name, node, _ in trainers:
            identity = node.peer.identity  # type: ignore[attr-defined]
            made = MetricsReporter(node, RUN, identity, period=0.1, expiration=60.0, username=name)
            made.start()
            reporters.append(made)
        collector = MetricsCollector(coordinator, RUN, authority_public_key=None, period=0.1)
        collector.start()
        register_dashboard(
            coordinator.peer,  # type: ignore[arg-type]
            collector,
            title="Browser test run",
            run_info=lambda: {
                "run_id": RUN,
                "time": 1764100000.0,
                "kit_version": "9.9",
                "install": WHEEL,
                "install_sha256": DIGEST,
            },
        )

        async def notebook(request: HttpRequest) -> HttpResponse:
            return HttpResponse(200, join_notebook_bytes(LINK), "application/x-ipynb+json")

        coordinator.peer.add_http_route(JOIN_NOTEBOOK_PATH, notebook)  # type: ignore[attr-defined]
        try:
            for epoch in range(EPOCHS):  # losses fall as the run goes
                for (_, _, per_epoch), made in zip(trainers, reporters, strict=True):
                    made.update(
                        epoch=epoch,
                        loss=4.0 / (epoch + 1) + per_epoch / 100,
                        samples_total=per_epoch * (epoch + 1),
                        samples_per_second=per_epoch / 10,
                    )
                await wait_for_epochs(collector, epoch + 1)
            port = coordinator.peer.listen_port  # type: ignore[attr-defined]
            dom = await dump_dom(f"http://127.0.0.1:{port}/", tmp_path / "profile")
        finally:
            for made in reporters:
                await made.shutdown(final_store=False)
            await collector.shutdown()

    def curve(name: str) -> list[str]:
        path = re.search(rf'<path class="curve" id="{name}-curve" d="([^"]*)"', dom)
        assert path is not None, dom[:2000]
        return re.findall(r"[ML]\s*-?[\d.]+ -?[\d.]+", path.group(1))

    assert len(curve("loss")) >= EPOCHS
    # peers online and samples/s over time: one point per collection, next to the loss
    assert len(curve("peers")) >= 2 and len(curve("speed")) >= 2
    assert re.search(r'id="peers-y-max"[^>]*>3<', dom), "3 peers at the top of the chart"
    table = re.search(r'<table id="leaderboard">(.*?)</table>', dom, re.S)
    assert table is not None
    rows = re.findall(r'<tr class="user-row">(.*?)</tr>', table.group(1), re.S)
    names = [
        html.unescape(re.search(r'<td class="username">(.*?)(?:<span|</td>)', row, re.S).group(1))  # type: ignore[union-attr]
        for row in rows
    ]
    assert names == ["alice", XSS_NAME, "bob"]  # by samples: 288, 192, 96
    assert [re.search(r'<td class="num samples">([\d,]+)</td>', r).group(1) for r in rows] == [  # type: ignore[union-attr]
        "288",
        "192",
        "96",
    ]
    assert '<td class="num rank">1</td>' in rows[0]
    # the hostile user name is shown as text, never run as markup
    markup = re.sub(r"<script.*?</script>", "", dom, flags=re.S)
    assert "<img" not in markup and "&lt;img src=x" in table.group(1)
    title = re.search(r"<title>(.*?)</title>", dom)
    assert title is not None and title.group(1) == "Browser test run"
    peers_online = re.search(r'id="peers-online">(\d+)<', dom)
    assert peers_online is not None and peers_online.group(1) == "3"
    step = re.search(r'id="global-step">(\d+)<', dom)
    assert step is not None and step.group(1) == str(EPOCHS - 1)
    assert "Browser test run" in dom
    facts = re.search(r'<p id="run-info">(.*?)</p>', dom)
    assert facts is not None and facts.group(1) == "run browser-test · kit 9.9", facts
    assert "1764100000" not in dom  # no raw Unix time anywhere
    status = re.search(r'<p id="status">(.*?)</p>', dom)
    assert status is not None and re.fullmatch(r"updated (just now|\d+ s ago)", status.group(1))
    # the cell volunteers paste, with the link in it, a copy button and the notebook to download
    join = re.search(r'<section class="card" id="join">(.*?)</section>', dom, re.S)
    assert join is not None, "the join card is hidden"
    cell = html.unescape(
        re.search(r'<code id="join-cell">(.*?)</code>', join.group(1), re.S).group(1)
    )  # type: ignore[union-attr]
    assert f'COORDINATOR = "{LINK}"' in cell and "kit.join(COORDINATOR)" in cell
    assert 'id="copy-cell"' in join.group(1) and 'href="join.ipynb"' in join.group(1)
    assert "Colab" in join.group(1) and "Kaggle" in join.group(1)
    pinned = html.escape(f'pip install "kit-collab @ {WHEEL}#sha256={DIGEST}"', quote=False)
    assert f"kit join {LINK}" in join.group(1) and pinned in join.group(1), join.group(1)
