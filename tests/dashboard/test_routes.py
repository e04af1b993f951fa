"""The dashboard's routes, over real HTTP GETs to a real peer's port."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from kit.dashboard.routes import load_page, register_dashboard
from kit.errors import KitUsageError
from kit.metrics.collector import MetricsCollector
from kit.metrics.records import ContributionRecord
from kit.p2p.identity import Identity
from kit.p2p.peer import create_peer
from tests.dht.swarm import Swarm

pytestmark = pytest.mark.sockets
RUN = "dashboard-test"
XSS_NAME = '<script>alert("x")</script>&'


def record(identity: Identity, username: str, epoch: int, samples: int, now: float) -> Any:
    body = ContributionRecord(
        peer_id=identity.peer_id.to_bytes(),
        session="s",
        username=username,
        token=None,
        epoch=epoch,
        loss=5.0 - epoch,
        samples_total=samples,
        compute_seconds=60.0,
        samples_per_second=2.5,
        time=now,
        client_mode=False,
        auxiliary=False,
        device="cpu",
    )
    return identity.public_key, body


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


async def test_page_and_json_api_over_http() -> None:
    async with Swarm(functools.partial(create_peer, host="127.0.0.1", run_id=RUN)) as swarm:
        node = await swarm.add_node()
        collector = MetricsCollector(node, RUN, authority_public_key=None)
        now = time.time()
        alice, mallory = Identity.generate(), Identity.generate()
        for epoch in range(3):
            collector.book.add(
                [
                    record(alice, "alice", epoch, 100 * (epoch + 1), now - 30 + epoch),
                    record(mallory, XSS_NAME, epoch, 10 * (epoch + 1), now - 30 + epoch),
                ],
                now - 30 + epoch,
            )
        calls = []

        def run_info() -> dict[str, Any]:
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("the coordinator's callback broke")
            return {"run_id": RUN, "target_batch_size": 4096}

        register_dashboard(node.peer, collector, title="<b>Run</b> & co", run_info=run_info)  # type: ignore[arg-type]
        base = f"http://127.0.0.1:{node.peer.listen_port}"  # type: ignore[attr-defined]

        status, headers, body = await asyncio.to_thread(get, base + "/")
        page = body.decode()
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "<title>&lt;b&gt;Run&lt;/b&gt; &amp; co</title>" in page and "<b>Run" not in page
        nonce = re.search(r"script-src 'nonce-([^']+)'", headers["Content-Security-Policy"])
        assert nonce is not None and f'<script nonce="{nonce.group(1)}">' in page
        assert "connect-src 'self'" in headers["Content-Security-Policy"]
        assert 'id="loss-chart"' in page and 'id="leaderboard"' in page
        assert "http://" not in page and "https://" not in page  # no CDN, no external fetch
        second = await asyncio.to_thread(get, base + "/")
        assert second[1]["Content-Security-Policy"] != headers["Content-Security-Policy"]

        status, headers, body = await asyncio.to_thread(get, base + "/api/metrics")
        metrics = json.loads(body)
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert metrics["run"] == {"run_id": RUN, "target_batch_size": 4096}
        assert [p["epoch"] for p in metrics["loss_curve"]] == [0, 1, 2]
        assert metrics["loss_curve"][2]["loss"] == pytest.approx(3.0)
        assert metrics["summary"]["global_epoch"] == 2
        assert metrics["summary"]["peers_online"] == 2

        status, _, body = await asyncio.to_thread(get, base + "/api/metrics")
        assert status == 200 and json.loads(body)["run"] == {}  # a broken run_info is survived

        status, _, body = await asyncio.to_thread(get, base + "/api/leaderboard")
        rows = json.loads(body)["leaderboard"]
        assert status == 200
        assert [(r["username"], r["samples"]) for r in rows] == [("alice", 300), (XSS_NAME, 30)]

        with pytest.raises(KitUsageError):
            register_dashboard(node.peer, collector, title="again")  # type: ignore[arg-type]


def test_page_template_is_packaged_and_escapes_through_text_content_only() -> None:
    page = load_page()
    assert "{{TITLE}}" in page and "{{NONCE}}" in page
    assert "innerHTML" not in page and "outerHTML" not in page and "insertAdjacentHTML" not in page
    assert "<script src" not in page and "<link" not in page
