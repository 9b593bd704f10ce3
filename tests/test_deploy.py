"""The deployment files agree with the server: every `PERSONAPLEX_*` variable they set is a setting and parses, the
probes they name are the server's routes, and the kill timers leave room for the drain and the final close.
(deploy/haproxy.cfg runs for real in tests/test_haproxy.py.)
"""

from __future__ import annotations

import re

import pytest
from process_support import ROOT

from app.doors.webrtc.routes import CALLS_ROUTE
from app.shell.settings import Settings, parse_settings

yaml = pytest.importorskip("yaml")

PROBES = {"/health/live", "/health/ready"}


def _env_settings(env: dict[str, str]) -> Settings:
    """The settings these variables make (an unknown PERSONAPLEX_* name fails: it would be silently ignored)."""
    known = {"PERSONAPLEX_" + name.upper() for name in vars(Settings())}
    unknown = {k for k in env if k.startswith("PERSONAPLEX_")} - known
    assert not unknown, unknown
    return parse_settings([], env)


def test_the_kubernetes_example_probes_the_server_and_outlasts_the_drain():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value", "secret") for e in container["env"]}
    settings = _env_settings(env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port, "agent": settings.agent_port}
    assert settings.host == "0.0.0.0"
    paths = {container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == PROBES and container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] > settings.drain_timeout_s + settings.shutdown_timeout_s
    services = [d for d in docs if d["kind"] == "Service"]
    headless = next(s for s in services if s["spec"].get("clusterIP") == "None")
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"http", "agent"}


def test_the_dockerfile_checks_liveness_and_sets_real_settings():
    text = (ROOT / "Dockerfile").read_text()
    env_block = text[text.index("ENV PERSONAPLEX_"):].split("\nEXPOSE")[0]
    env = dict(re.findall(r"(PERSONAPLEX_\w+)=(\S+)", env_block))
    settings = _env_settings(env)
    assert f"EXPOSE {settings.port}/tcp {settings.agent_port}/tcp" in text
    assert "/health/live" in text.split("HEALTHCHECK", 1)[1].split("\n\n")[0]
    stop_timeout = int(re.search(r"docker stop -t (\d+)", text).group(1))
    assert stop_timeout > settings.drain_timeout_s + settings.shutdown_timeout_s


def test_the_haproxy_config_routes_call_follow_ups_and_asks_the_agent():
    text = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert f"path_beg {CALLS_ROUTE}/" in text and "res.hdr(Location)" in text
    assert "option httpchk GET /health/live" in text and "agent-check" in text and "balance leastconn" in text
