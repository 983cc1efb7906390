"""Flags that belong to one command: sglang-router's spelling of a PD router, and a server's role refused offline."""

from __future__ import annotations

import pytest

from moeplex.cli import build_parser, main
from moeplex.cli.router import settings_from

P1, P2, D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30002", "http://127.0.0.1:30011", "http://127.0.0.1:30012"


def router_settings(*argv: str):
    return settings_from(build_parser().parse_args(["router", *argv]))


@pytest.mark.parametrize("argv", [
    ["--pd", "--prefill", f"{P1},9001", f"{P2},9002", "--decode", D1, D2],
    ["--pd-disaggregation", "--prefill", P1, "9001", "--prefill", P2, "9002", "--decode", D1, "--decode", D2],
    ["--pd-disaggregation", "--prefill", P1, "9001", "--prefill", f"{P2},9002", "--decode", D1, D2],
], ids=["ours", "sglang-router", "mixed"])
def test_sglang_routers_spelling_of_a_pd_router_means_the_same(argv):
    settings = router_settings(*argv)
    assert settings.pd and settings.prefill == (f"{P1},9001", f"{P2},9002") and settings.decode == (D1, D2)


def test_a_prefill_server_without_a_port_takes_the_default():
    settings = router_settings("--pd-disaggregation", "--prefill", P1, "none", "--prefill", P2, "--decode", D1)
    assert settings.prefill == (P1, P2)


@pytest.mark.parametrize("argv", [["--prefill", "9001", P1], ["--prefill", f"{P1},9001", "9002"],
                                  ["--prefill", P1, "9001", "9002"]])
def test_a_bootstrap_port_must_follow_a_url_without_one(argv):
    with pytest.raises(ValueError, match="follows no prefill server URL"):
        router_settings("--pd", *argv, "--decode", D1)


@pytest.mark.parametrize("command", ["generate", "bench-one-batch"])
@pytest.mark.parametrize("flag", [["--disaggregation-mode", "prefill"], ["--disaggregation-lease=3"],
                                  ["--disaggregation-transfer-backend", "zmq"]])
def test_offline_commands_refuse_a_servers_role_in_one_sentence(command, flag, capsys):
    extra = ["--input-ids", "1,2"] if command == "generate" else []
    with pytest.raises(SystemExit) as exit:
        main([command, *extra, *flag])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit.value.code == 2 and "is a flag of `moeplex serve`" in error and flag[0].split("=")[0] in error, error


def test_serve_still_takes_its_role():
    args = build_parser().parse_args(["serve", "--disaggregation-mode", "decode", "--disaggregation-lease", "5"])
    assert args.disaggregation_mode == "decode" and args.disaggregation_lease == 5
