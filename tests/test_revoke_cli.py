"""``kit revoke`` against a real coordinator on loopback: a ban by the command line cuts the user
off at the coordinator and at another volunteer (its own process), refuses their new token,
survives a restart, shows in ``--list`` and on the dashboard's API; bad input, replayed and
forged requests are refused with a reason and change nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from kit.auth.revocation import REVOCATION_DOMAIN, RevocationList
from kit.auth.tokens import TOKEN_DOMAIN
from kit.cli import main
from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions, create_authority
from kit.coordinator_file import (
    CoordinatorFile,
    coordinator_file_path,
    local_url,
    read_coordinator_file,
    remove_coordinator_file,
    write_coordinator_file,
)
from kit.dashboard import load_page
from kit.errors import (
    ConfigError,
    ConnectionLost,
    HandshakeRefused,
    MalformedToken,
    Revoked,
)
from kit.p2p.identity import Identity, b58encode
from kit.p2p.peer import Peer
from kit.revocation_admin import (
    BANS_PATH,
    MAX_REQUEST_BYTES,
    REQUEST_DOMAIN,
    REVOKE_PATH,
    RevokeRequest,
)
from kit.revoke_cli import Bans, human_duration, parse_duration, parse_peer_key
from kit.run_authority import read_authority, revocations_path
from kit.runtime import get_runtime
from kit.testing.fake_hub import FakeHub
from tests.auth import volunteer_process
from tests.auth.members import CoordinatorMembers
from tests.conftest import TIMEOUT_FACTOR
from tests.test_coordinator import access_coordinator, free_port

pytestmark = [pytest.mark.sockets]
ROOT = Path(__file__).resolve().parents[1]
USERS = ("alice", "bob", "carol", "dave")


# --- helpers -------------------------------------------------------------------------------------


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout * TIMEOUT_FACTOR
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kit_revoke(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kit revoke ARGS`` in its own process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "kit", "revoke", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def revoke_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``kit.cli.main(["revoke", ...])``: its exit code and what it printed on stdout."""
    capsys.readouterr()
    code = main(["revoke", *args])
    return code, capsys.readouterr().out


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    with FakeHub() as fake:
        for user in USERS:
            fake.add_user(user, token=f"hf_{user}", token_role="read")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake


def kept_bans(coordinator: Coordinator) -> tuple[float, tuple, tuple, bytes | None]:
    """What a refused request must leave as it was: the list held, and the one kept on disk."""
    issuer = coordinator.issuer
    assert issuer is not None
    held = issuer.revocations
    path = revocations_path(coordinator.state_dir)
    return (
        held.issued_at,
        held.usernames,
        held.peer_public_keys,
        path.read_bytes() if path.exists() else None,
    )


async def hold_open(peer: Peer, address: str) -> object:
    """A stream from ``peer`` to the volunteer at ``address`` (its ``test/hold`` echo)."""
    volunteer = await peer.connect(address, timeout=10)
    stream = await peer.open_stream(volunteer, "test/hold", timeout=10)
    await stream.send_message(b"hi", timeout=10)
    assert await stream.receive_message(timeout=10) == b"hi"
    return stream


async def refused_by(peer: Peer, address: str) -> HandshakeRefused:
    """The refusal of ``peer``'s dial to ``address``, within a few of the other side's check
    periods (until it learns the ban from the DHT, a dial succeeds and is then closed)."""
    deadline = time.monotonic() + 20 * TIMEOUT_FACTOR
    while time.monotonic() < deadline:
        try:
            await peer.connect(address, timeout=10)
        except HandshakeRefused as refusal:
            return refusal
        await asyncio.sleep(0.2)
    raise AssertionError(f"{address} still admits {peer.peer_id.short()}")


# --- end to end --------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_ban_by_kit_revoke_holds_at_the_coordinator_and_every_peer_and_after_a_restart(
    tmp_path: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    """carol holds a stream to a volunteer (bob's peer, its own process) and a connection to
    the coordinator; dave a connection to the coordinator. ``python -m kit revoke --user carol``
    (a real process) and ``kit revoke --peer-key <dave's key>`` (in process): the coordinator and
    the volunteer close their connections, refuse their dials, carol gets no new token; alice
    goes on. The bans show in ``--list`` and /api/bans, and hold after a restart."""
    state = tmp_path / "coordinator"
    coordinator = access_coordinator(state, hub.endpoint, usernames=USERS, check_seconds=1.0)
    assert read_coordinator_file(state) == CoordinatorFile(
        coordinator.http_url,
        coordinator.config.collaboration.run_id,
        coordinator.config.access.authority_public_key,
        os.getpid(),
    )
    volunteer = volunteer_process.start(coordinator.join_url, "hf_bob", tmp_path / "bob")
    members = CoordinatorMembers(coordinator)
    run = get_runtime().call
    coordinator_id = coordinator.dht.peer_id  # type: ignore[union-attr]
    try:
        assert volunteer.stdout is not None
        address = volunteer.stdout.readline().strip()
        assert address, "the volunteer did not start"
        carol = run(members.join("carol"), timeout=60)
        dave = run(members.join("dave"), timeout=60)
        stream = run(hold_open(carol, address), timeout=60)
        for peer in (carol, dave):
            assert run(peer.connect(coordinator.addresses[0], timeout=10), timeout=30)
        assert carol.connection(coordinator_id) is not None

        done = kit_revoke("--state-dir", str(state), "--user", "carol", "--duration", "10m")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("banned for 10 min: user carol\n"), done.stdout
        assert "1 active ban (from the coordinator at http://127.0.0.1:" in done.stdout
        assert "  user carol  until " in done.stdout and "left)" in done.stdout

        async def carol_cut_off_at_the_volunteer() -> None:
            with pytest.raises(ConnectionLost, match="unauthorized.*user 'carol' is revoked"):
                await stream.receive_message(timeout=30)  # type: ignore[attr-defined]

        run(carol_cut_off_at_the_volunteer(), timeout=60)
        wait_for(lambda: carol.connection(coordinator_id) is None, 10, "carol cut off")
        for where in (address, coordinator.addresses[0]):
            with pytest.raises(HandshakeRefused, match="user 'carol' is revoked"):
                run(carol.connect(where, timeout=10), timeout=30)
        with pytest.raises(Revoked, match="help:"):  # no new token, whatever her key
            run(members.join("carol"), timeout=60)

        dave_key = b58encode(dave.identity.public_key)
        code, out = revoke_in_process(
            capsys, "--state-dir", str(state), "--peer-key", dave_key, "--duration", "2h"
        )
        assert code == 0
        assert out.startswith(f"banned for 2 h: key {dave_key}\n"), out
        wait_for(lambda: dave.connection(coordinator_id) is None, 10, "dave cut off")
        refusal = run(refused_by(dave, address), timeout=60)  # the volunteer too, once it polled
        assert f"peer {dave.peer_id.short()} is revoked" in str(refusal)

        alice = run(members.join("alice"), timeout=60)  # never banned: goes on
        run(hold_open(alice, address), timeout=60)

        code, out = revoke_in_process(capsys, "--state-dir", str(state), "--list")
        assert code == 0
        lines = out.splitlines()
        assert "2 active bans (from the coordinator at" in lines[0]
        assert lines[1].startswith("  user carol ") and "until" in lines[1]
        assert lines[2].startswith(f"  key  {dave_key} (peer {dave.peer_id.short()})")
        assert "(1 h 59 min left)" in lines[2] or "(2 h left)" in lines[2]

        status, bans = get(coordinator.http_url + BANS_PATH)  # the dashboard's API
        assert status == 200 and bans["authority"] is True
        assert [u["username"] for u in bans["users"]] == ["carol"]
        assert [k["public_key"] for k in bans["peer_keys"]] == [dave_key]
        assert bans["peer_keys"][0]["peer_id"] == dave.peer_id.to_base58()
        assert 500 < bans["users"][0]["until"] - time.time() <= 600

        coordinator.shutdown()
        assert not coordinator_file_path(state).exists()  # removed at shutdown
        done = kit_revoke("--state-dir", str(state), "--list")
        assert done.returncode == 0, done.stderr
        assert f"no coordinator answers from {state}; the list kept in" in done.stdout
        assert "2 active bans" in done.stdout and "user carol" in done.stdout
        done = kit_revoke("--state-dir", str(state), "--user", "alice")
        assert done.returncode == 1
        assert f"no coordinator is running from {state}" in done.stderr and "help:" in done.stderr

        coordinator = access_coordinator(state, hub.endpoint, usernames=USERS, check_seconds=1.0)
        members.coordinator = coordinator
        with pytest.raises(Revoked, match="help:"):  # kept across the restart
            run(members.join("carol"), timeout=60)
        code, out = revoke_in_process(capsys, "--state-dir", str(state), "--list")
        assert code == 0 and "2 active bans (from the coordinator at" in out
        assert get(coordinator.http_url + BANS_PATH)[1]["users"][0]["username"] == "carol"
    finally:
        run(members.leave(), timeout=30)
        if volunteer.stdin is not None:
            volunteer.stdin.close()
        try:
            volunteer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            volunteer.kill()
            volunteer.wait(timeout=10)
        coordinator.shutdown()


def test_bad_input_gives_a_clear_error_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "coordinator"
    coordinator = access_coordinator(state, "http://127.0.0.1:9", usernames=("alice",))
    before = kept_bans(coordinator)

    def refused(code: int, *args: str, match: str) -> None:
        caplog.clear()
        got, out = revoke_in_process(capsys, *args)
        assert (got, out) == (code, ""), (args, caplog.text)
        assert match in caplog.text and "help:" in caplog.text, (args, caplog.text)
        assert kept_bans(coordinator) == before

    here = ("--state-dir", str(state))
    key = b58encode(Identity.generate().public_key)
    try:
        # A bad command line: exit code 2, nothing sent.
        refused(2, *here, match="nobody to ban")
        refused(2, *here, "--user", "al ice", match="'al ice' is not a Hugging Face user name")
        refused(2, *here, "--user", "@coordinator", match="is not a Hugging Face user name")
        refused(2, *here, "--user", "alice", "--user", "x" * 97, match="is not a Hugging Face")
        refused(2, *here, "--peer-key", "0OIl", match="is not a peer's public key")
        refused(2, *here, "--peer-key", key[:-4], match="is not a peer's public key")
        refused(2, *here, "--user", "alice", "--duration", "soon", match="is not a duration")
        refused(2, *here, "--user", "alice", "--duration", "0", match="more than 0 s")
        refused(2, *here, "--user", "alice", "--duration", "400d", match="at most 365 days")
        refused(2, *here, "--list", "--user", "alice", match="--list bans nobody")
        many = [arg for i in range(33) for arg in ("--user", f"user{i}")]
        refused(2, *here, *many, match="33 bans in one request")

        # The wrong state dir, or the right one without its coordinator: exit code 1.
        refused(
            1, "--state-dir", str(tmp_path / "nowhere"), "--user", "alice", match="no authority key"
        )
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "authority.key").write_bytes(b"12345")
        refused(1, "--state-dir", str(broken), "--user", "alice", match="is not an authority key")
        idle = tmp_path / "idle"
        create_authority(idle)
        refused(
            1,
            "--state-dir",
            str(idle),
            "--user",
            "alice",
            match=f"no coordinator is running from {idle}",
        )
        code, out = revoke_in_process(capsys, "--state-dir", str(idle), "--list")
        assert code == 0 and out.startswith(f"nobody is banned (no coordinator answers from {idle}")
        # A coordinator.json left by a process that ended, or naming a port nobody listens on.
        ended = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        stale = {
            "url": f"http://127.0.0.1:{free_port()}",
            "run_id": coordinator.config.collaboration.run_id,
            "authority_public_key": create_authority(idle),
            "pid": int(ended.stdout),
            "started": 0.0,
        }
        coordinator_file_path(idle).write_text(json.dumps(stale))
        refused(1, "--state-dir", str(idle), "--user", "alice", match="which has ended")
        coordinator_file_path(idle).write_text(json.dumps({**stale, "pid": os.getpid()}))
        refused(
            1,
            "--state-dir",
            str(idle),
            "--user",
            "alice",
            match="nothing answers at http://127.0.0.1:",
        )
        coordinator_file_path(idle).write_text("{not json")
        refused(1, "--state-dir", str(idle), "--user", "alice", match="is unreadable")

        # This run's key, but the coordinator answering there is another run's (a stale file).
        other_run = tmp_path / "other-run"
        other_run.mkdir()
        (other_run / "authority.key").write_bytes((state / "authority.key").read_bytes())
        running = json.loads(coordinator_file_path(state).read_text())
        coordinator_file_path(other_run).write_text(json.dumps({**running, "run_id": "other-run"}))
        refused(
            1,
            "--state-dir",
            str(other_run),
            "--user",
            "alice",
            match=f"runs {coordinator.config.collaboration.run_id!r}, not 'other-run'",
        )
        # The running coordinator's file, but another authority key.
        other_key = tmp_path / "other-key"
        create_authority(other_key)
        coordinator_file_path(other_key).write_text(json.dumps(running))
        refused(
            1, "--state-dir", str(other_key), "--user", "alice", match="is not the authority of run"
        )
    finally:
        coordinator.shutdown()


def test_an_open_run_cannot_ban_and_says_how_to_get_an_authority(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "open"
    port = free_port()
    access = dataclasses.replace(RunConfig().access, coordinator=f"/ip4/127.0.0.1/tcp/{port}/ws")
    options = CoordinatorOptions(
        host="127.0.0.1", port=port, state_dir=str(state), auxiliary_peer=False, preflight=False
    )
    with Coordinator(dataclasses.replace(RunConfig(), access=access), options) as coordinator:
        assert read_coordinator_file(state).authority_public_key is None  # type: ignore[union-attr]
        for args, match in (
            (("--user", "alice"), "no authority key"),
            (("--list",), "is open"),
        ):
            caplog.clear()
            code, out = revoke_in_process(capsys, "--state-dir", str(state), *args)
            assert (code, out) == (1, "") and match in caplog.text and "help:" in caplog.text
        create_authority(state)  # a key, but not in run.yaml: still an open run
        caplog.clear()
        code, _ = revoke_in_process(capsys, "--state-dir", str(state), "--user", "alice")
        assert code == 1 and "is open" in caplog.text and "--create-authority" in caplog.text
        request = RevokeRequest.sign(
            read_authority(state), "sahajbert", usernames=["alice"], duration=60.0, now=time.time()
        )
        status, answer = get(
            coordinator.http_url + REVOKE_PATH, {"Authorization": request.header()}
        )
        assert status == 409 and answer["error"] == "open_run" and "help:" in answer["message"]
        status, bans = get(coordinator.http_url + BANS_PATH)
        assert status == 200 and bans["authority"] is False and bans["users"] == []


def test_replayed_forged_stale_and_malformed_requests_are_refused_and_change_nothing(
    tmp_path: Path,
) -> None:
    state = tmp_path / "coordinator"
    coordinator = access_coordinator(state, "http://127.0.0.1:9", usernames=("alice",))
    authority = read_authority(state)
    run_id = coordinator.config.collaboration.run_id
    url = coordinator.http_url + REVOKE_PATH

    def send(header: str | None) -> tuple[int, dict]:
        return get(url, {} if header is None else {"Authorization": header})

    def request(signer: Identity = authority, **changes: object) -> RevokeRequest:
        signed = RevokeRequest.sign(
            signer, run_id, usernames=["mallory"], duration=600.0, now=time.time()
        )
        return dataclasses.replace(signed, **changes) if changes else signed  # type: ignore[arg-type]

    try:
        valid = request()
        status, answer = send(valid.header())
        assert status == 200 and [u["username"] for u in answer["users"]] == ["mallory"]
        before = kept_bans(coordinator)
        assert before[3] is not None  # kept on disk
        refusals: list[tuple[str | None, int, str]] = [
            (valid.header(), 409, "replayed"),  # the same request again
            (request(Identity.generate()).header(), 401, "bad_signature"),  # another key
            (request(duration=7200.0).header(), 401, "bad_signature"),  # changed after signing
            (request(run_id="other-run").header(), 403, "other_run"),
            (None, 400, "malformed"),
            ("Bearer " + valid.header().split()[1], 400, "malformed"),
            ("KitRevoke !!!", 400, "malformed"),
            ("KitRevoke " + "A" * 7000, 400, "malformed"),  # over the size limit
        ]
        # Signed right, but stale (a request recorded 10 minutes ago), or for no Hub name.
        stale = RevokeRequest.sign(
            authority, run_id, usernames=["mallory"], duration=60.0, now=time.time() - 600
        )
        refusals.append((stale.header(), 401, "stale"))
        unsigned = dataclasses.replace(request(), usernames=("@coordinator",))
        forged_name = dataclasses.replace(
            unsigned, signature=authority.sign(unsigned.signed_payload())
        )
        refusals.append((forged_name.header(), 400, "malformed"))
        for header, code, error in refusals:
            status, answer = send(header)
            assert (status, answer["error"]) == (code, error), answer
            assert "help:" in answer["message"]
            assert kept_bans(coordinator) == before
        # A fresh request of the same content is applied: only the nonce was refused.
        status, _ = send(request().header())
        assert status == 200 and kept_bans(coordinator)[0] > before[0]
    finally:
        coordinator.shutdown()


# --- the pieces ----------------------------------------------------------------------------------


def test_kit_revoke_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["revoke", "--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    for option in ("--state-dir", "--user", "--peer-key", "--duration", "--list", "30m, 12h, 1d"):
        assert option in usage
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "revoke" in capsys.readouterr().out


def test_a_request_survives_the_wire_and_is_decoded_strictly() -> None:
    authority = Identity.generate()
    key = Identity.generate().public_key
    request = RevokeRequest.sign(
        authority, "run", usernames=["alice"], peer_public_keys=[key], duration=60.0, now=1e9
    )
    again = RevokeRequest.from_header(request.header())
    assert again == request and again.verify(authority.public_key)
    assert not again.verify(Identity.generate().public_key)
    assert (
        len(request.nonce) == 16
        and request.nonce
        != RevokeRequest.sign(authority, "run", usernames=["alice"], duration=60.0, now=1e9).nonce
    )
    # Domain-separated: the bytes signed are no access token's nor revocation list's.
    payload = request.signed_payload()
    assert payload.startswith(REQUEST_DOMAIN)
    for other in (TOKEN_DOMAIN, REVOCATION_DOMAIN):
        assert not payload.startswith(other) and not other.startswith(REQUEST_DOMAIN)
    body = msgpack.unpackb(request.to_bytes())
    for change in (
        {"extra": 1},
        {"v": 2},
        {"duration": 60},  # an int where a float belongs
        {"users": ["al ice"]},
        {"users": [b"alice"]},
        {"keys": [key[:31]]},
        {"keys": ["not bytes"]},
        {"users": [], "keys": []},
        {"users": [f"u{i}" for i in range(33)]},
        {"duration": float("inf")},
        {"nonce": b"short"},
        {"sig": b"short"},
        {"run": ""},
    ):
        with pytest.raises(MalformedToken):
            RevokeRequest.from_bytes(msgpack.packb({**body, **change}, use_bin_type=True))
    with pytest.raises(MalformedToken):
        RevokeRequest.from_bytes(b"\x00" * (MAX_REQUEST_BYTES + 1))
    with pytest.raises(MalformedToken):
        RevokeRequest.from_bytes(msgpack.packb(msgpack.ExtType(1, b"x")))
    with pytest.raises(ConfigError, match="help:"):
        RevokeRequest.sign(authority, "run", usernames=["@coordinator"], duration=1.0, now=1.0)


def test_command_line_values() -> None:
    assert [parse_duration(t) for t in ("30m", "12h", "1d", "7d", "1w", "3600", "90s", "1.5h")] == [
        1800.0,
        43200.0,
        86400.0,
        604800.0,
        604800.0,
        3600.0,
        90.0,
        5400.0,
    ]
    for bad in ("", "soon", "-1d", "1y", "1d2h"):
        with pytest.raises(ConfigError, match="help:"):
            parse_duration(bad)
    key = Identity.generate().public_key
    assert parse_peer_key(b58encode(key)) == key
    for bad in ("", "0OIl", b58encode(key + b"x")):
        with pytest.raises(ConfigError, match="help:"):
            parse_peer_key(bad)
    assert [human_duration(s) for s in (0, 59, 600, 7260, 86400, 90000)] == [
        "0 s",
        "59 s",
        "10 min",
        "2 h 1 min",
        "1 d",
        "1 d 1 h",
    ]
    assert local_url("0.0.0.0", 80, secure=False) == "http://127.0.0.1:80"
    assert local_url("::", 443, secure=True) == "https://[::1]:443"
    assert local_url("10.0.0.2", 8765, secure=False) == "http://10.0.0.2:8765"


def test_the_list_prints_active_bans_only() -> None:
    authority = Identity.generate()
    key = Identity.generate().public_key
    listed = RevocationList("run", 0.0).revoke(usernames=["bob"], until=1000.0 + 3600)
    listed = listed.revoke(usernames=["old"], until=900.0).revoke(
        peer_public_keys=[key], until=1000.0 + 90
    )
    text = Bans("run", listed.sign(authority, 1.0), 1000.0, "from somewhere").text()
    assert text.splitlines()[0] == "run run: 2 active bans (from somewhere)"
    assert "old" not in text and "1970-01-01 01:16:40 UTC (1 h left)" in text
    assert f"  key  {b58encode(key)}" in text and "(1 min 30 s left)" in text
    assert Bans("run", None, 0.0, "kept").text() == "run run: nobody is banned (kept)"


def test_coordinator_json_is_written_atomically_and_removed_by_its_writer_only(
    tmp_path: Path,
) -> None:
    config = RunConfig()
    write_coordinator_file(tmp_path, config, "0.0.0.0", 8765, secure=True)
    found = read_coordinator_file(tmp_path)
    assert found == CoordinatorFile("https://127.0.0.1:8765", "sahajbert", None, os.getpid())
    assert not list(tmp_path.glob("*.partial"))
    path = coordinator_file_path(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": os.getpid() + 1}))
    remove_coordinator_file(tmp_path)  # another process's: kept
    assert path.exists()
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": os.getpid()}))
    remove_coordinator_file(tmp_path)
    assert not path.exists() and read_coordinator_file(tmp_path) is None
    remove_coordinator_file(tmp_path)  # nothing there: nothing happens
    path.write_text(json.dumps({"url": 1}))
    with pytest.raises(ConfigError, match="help:"):
        read_coordinator_file(tmp_path)


def test_the_dashboard_page_shows_the_bans_as_text() -> None:
    page = load_page()
    assert 'id="bans"' in page and 'getJson("api/bans")' in page
    assert "innerHTML" not in page


def test_a_kept_list_of_another_authority_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    create_authority(tmp_path)
    forged = RevocationList("kit-run", 0.0).revoke(usernames=["bob"], until=time.time() + 60)
    revocations_path(tmp_path).write_bytes(forged.sign(Identity.generate(), 1.0).to_bytes())
    code, out = revoke_in_process(capsys, "--state-dir", str(tmp_path), "--list")
    assert (code, out) == (1, "") and "is unreadable" in caplog.text and "help:" in caplog.text
    good = forged.sign(read_authority(tmp_path), 1.0)
    revocations_path(tmp_path).write_bytes(good.to_bytes())
    code, out = revoke_in_process(capsys, "--state-dir", str(tmp_path), "--list")
    assert code == 0 and "1 active ban (no coordinator answers from" in out and "user bob" in out
