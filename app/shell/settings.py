"""Server settings: one dataclass, filled from command-line flags over `PERSONAPLEX_*` environment variables.

Every flag has an environment twin (`--max-sessions` ↔ `PERSONAPLEX_MAX_SESSIONS`); a flag wins over its variable.
`HF_TOKEN` is read by `huggingface_hub` itself; the server only checks whether one is set.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from app.shell.model_choice import RANDOM_MODEL, TINY_MODEL, check_model_name
from model.config import DEFAULT_REPO as DEFAULT_MODEL
from model.engine.api import WARM_LEAD_MS

__all__ = ["DEFAULT_MODEL", "RANDOM_MODEL", "TINY_MODEL", "Settings", "build_parser", "parse_settings"]


@dataclass
class Settings:
    model: str = DEFAULT_MODEL            # a checkpoint folder, a known Hugging Face repo id, "tiny" or "random-7b"
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"                  # "auto": cuda when available, else cpu
    gpus: str = ""                        # one engine process per GPU: "all", "0,1" (or devices: "cuda:0,cpu");
                                          # empty: one engine on `device`
    dtype: str = "auto"                   # "auto": bfloat16 on cuda, float32 on cpu
    max_sessions: int = 4
    queue_timeout_s: float = 0.0          # >0: a connection waits this long for a free slot before `resource_exhausted`
    api_keys: tuple[str, ...] = ()        # empty: no auth
    allowed_origins: tuple[str, ...] = () # empty: any Origin
    voices_dir: Path | None = None        # extra voice files (.pt/.wav) clients may name
    log_level: str = "INFO"
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "personaplex-server")
    strict_model: bool = False            # True: a model that fails to load is fatal instead of falling back to tiny
    kv_cache: str = "bf16"                # "fp8": e4m3 KV cache, half the memory per session (about 2x sessions)
    kv_cache_gib: float = 0.0             # the KV cache at most this many GiB (per engine); 0: what the GPU has free
    mimi_decoder: str = "bf16"            # on a GPU, the streaming decoder's precision ("float32": as the reference)
    stun_url: str = ""                    # WebRTC ICE: none by default (host candidates: localhost and LAN)
    turn_url: str = ""
    turn_username: str = ""
    turn_credential: str = ""
    ice_relay_only: bool = False          # force TURN relay (needs turn_url)
    ice_connect_timeout_s: float = 20.0   # a call whose ICE + DTLS is not up this long after the answer ends
    webrtc_red: bool = True               # RED audio (RFC 2198) both ways with WebRTC callers that offer it
    max_message_bytes: int = 4 << 20      # one WebSocket message; larger closes with 1009
    first_message_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0         # read-idle period that ends a session
    max_events_per_s: float = 200.0       # flood bound per socket (token bucket, burst = 2 s worth)
    max_realtime_backlog_s: float = 4.0   # realtime WebSocket sessions: audio queued ahead of the engine (latency)
    max_input_backlog_s: float = 30.0     # input-paced sessions: audio queued ahead of the engine before backpressure
    max_output_backlog_s: float = 20.0    # output queued for a client that does not read before the socket closes
    shutdown_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0         # SIGTERM: live sessions may run this long before the final close
    agent_port: int = 0                   # HAProxy agent-check port (capacity, drain, down); 0: off
    workers: int = -1                     # network processes beside the engine process; 0: all in one process;
                                          # -1: from the core count (default_workers)
    input_lead_ms: float = 8.0            # workers send each tick's input this long before the engine's deadline
    max_output_bytes: int = 8 << 20       # output bytes queued for a client that does not read before the socket closes
    max_connections_per_ip: int = 64      # open sockets and calls per client address; more get HTTP 429
    audiosocket_port: int = 0             # Asterisk AudioSocket TCP door; 0: off
    engine_stalled_s: float = 2.0         # this long without an engine tick and /health reports the engine down
    engine_warm_lead_ms: float = WARM_LEAD_MS  # the engine wakes this long before each tick to warm its first calls
    sip_port: int = 0                     # SIP user agent server on UDP and TCP; 0: off (app/doors/sip)
    sip_address: str = ""                 # the address our SDP and Contact give; "": the bind address, else found
    rtp_ports: str = "20000-29999"        # RTP on even ports of this range, RTCP on the next odd one
    sip_agents: tuple[str, ...] = ()      # NAME=voice,persona-file: the request-URI user picks one
    sip_allow: tuple[str, ...] = ()       # CIDRs that may call; empty: any source
    sip_user: str = ""                    # digest authentication (with sip_password); "": none
    sip_password: str = ""
    sip_realm: str = "personaplex"
    sip_x_headers: bool = False           # callers may set persona/voice with X-Persona / X-Voice
    sip_own_worker: bool = True           # with workers >= 2: worker 0 serves the SIP door alone (app/shell/processes)
    record_dir: Path | None = None        # call recordings (app/calls/recording.py); None: off
    record_policy: str = "all"            # all, opt-in, opt-out: which calls are recorded (app.calls.recording.wanted)
    spool_dir: Path | None = None         # undelivered webhooks and live-call markers; None: cache_dir/spool-<port>
    webhook_url: str = ""                 # call.started / call.ended are POSTed here (app/calls/webhooks.py); "": off
    webhook_secret: str = ""              # signs each webhook (HMAC-SHA256)
    webhook_retry_s: float = 3600.0       # an undelivered webhook is retried this long, then given up
    webhook_backoff_max_s: float = 60.0   # the longest wait between two tries
    admin_key: str = ""                   # the admin API (/v1/calls) key, never a client key; "": the API is off


_ENV_PREFIX = "PERSONAPLEX_"
KV_CACHE_CHOICES = ("bf16", "fp8")
MIMI_DECODER_CHOICES = ("bf16", "float32")
RECORD_POLICIES = ("all", "opt-in", "opt-out")
# The settings that take one of a few words, each refused in one line when it takes another.
CHOICES = {"kv_cache": KV_CACHE_CHOICES, "mimi_decoder": MIMI_DECODER_CHOICES, "record_policy": RECORD_POLICIES}


@dataclass(frozen=True)
class Bound:
    """The values a numeric setting takes: from `low` (or above it, when `above`) up to `high`, finite."""

    low: float
    high: float = math.inf
    above: bool = False

    def admits(self, value: float) -> bool:
        return math.isfinite(value) and (value > self.low if self.above else value >= self.low) and value <= self.high

    def __str__(self) -> str:
        if self.high < math.inf:
            return f"from {self.low:g} to {self.high:g}"
        return f"{'>' if self.above else '>='} {self.low:g}"


_PORT, _POSITIVE, _NOT_NEGATIVE = Bound(0, 65535), Bound(0, above=True), Bound(0)
BOUNDS: dict[str, Bound] = {
    "port": _PORT, "agent_port": _PORT, "audiosocket_port": _PORT, "sip_port": _PORT,
    "max_sessions": Bound(1), "workers": Bound(0), "max_message_bytes": Bound(1), "max_output_bytes": Bound(1),
    "max_connections_per_ip": _NOT_NEGATIVE, "queue_timeout_s": _NOT_NEGATIVE, "shutdown_timeout_s": _NOT_NEGATIVE,
    "drain_timeout_s": _NOT_NEGATIVE, "input_lead_ms": _NOT_NEGATIVE, "ice_connect_timeout_s": _POSITIVE,
    "first_message_timeout_s": _POSITIVE, "idle_timeout_s": _POSITIVE, "max_events_per_s": _POSITIVE,
    "max_realtime_backlog_s": _POSITIVE, "max_input_backlog_s": _POSITIVE, "max_output_backlog_s": _POSITIVE,
    "engine_stalled_s": _POSITIVE, "webhook_retry_s": _POSITIVE, "webhook_backoff_max_s": _POSITIVE,
    "engine_warm_lead_ms": _NOT_NEGATIVE, "kv_cache_gib": _NOT_NEGATIVE,
}


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (its own print the whole usage first)."""

    def error(self, message: str) -> None:   # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (--help lists every flag)\n")


def split_csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = _Parser(
        prog="personaplex-server",
        description="Full-duplex speech-to-speech server for PersonaPlex-7B: browsers over WebRTC, apps over WebSocket "
                    "(the OpenAI Realtime dialect and a native one), phone lines over SIP/RTP and the media WebSockets "
                    "of Twilio, Telnyx, Vonage and FreeSWITCH, and Asterisk's AudioSocket.",
        epilog="Every flag has an environment twin: --max-sessions is PERSONAPLEX_MAX_SESSIONS (lists comma-separated, "
               "e.g. PERSONAPLEX_API_KEYS=k1,k2); a flag wins. HF_TOKEN is used for gated Hugging Face repos. Without "
               "a GPU, or when the model cannot be loaded, the server runs the built-in tiny test model and says so.",
    )
    p.add_argument("--model", help=f"checkpoint folder, a known Hugging Face repo id ({d.model}, or one already in "
                                   f"the local Hugging Face cache), 'tiny', or '{RANDOM_MODEL}' (the official shape "
                                   f"with random weights on the GPU, for sizing hardware) (default {d.model})")
    p.add_argument("--host", help=f"bind address (default {d.host})")
    p.add_argument("--port", type=int, help=f"TCP port, 0 = any free port (default {d.port})")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--dtype", help="float32, bfloat16, float16 or auto (default auto)")
    p.add_argument("--max-sessions", type=int, help=f"concurrent conversations (default {d.max_sessions})")
    p.add_argument("--queue-timeout-s", type=float, help="wait this long for a free slot (default 0: refuse at once)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="accepted API key (repeat; env: comma list)")
    p.add_argument("--allowed-origin", action="append", dest="allowed_origins", help="allowed Origin (repeat)")
    p.add_argument("--voices-dir", help="folder of extra voice prompts (.pt or .wav)")
    p.add_argument("--log-level", help=f"DEBUG, INFO, WARNING… (default {d.log_level})")
    p.add_argument("--cache-dir", help=f"where the built-in tiny model and the webhook spool are written "
                                       f"(default {d.cache_dir})")
    p.add_argument("--strict-model", action="store_true", default=None,
                   help="refuse to start when the model cannot be served (no GPU for it, or its load fails) instead "
                        "of serving the built-in tiny model")
    p.add_argument("--kv-cache", choices=KV_CACHE_CHOICES,
                   help=f"KV cache storage; fp8 holds about twice the sessions, close to but not bit-exact with bf16 "
                        f"(default {d.kv_cache})")
    p.add_argument("--kv-cache-gib", type=float,
                   help="GPU memory for the KV cache (every session's context), GiB per engine: on a GPU shared "
                        "with another service, what this server may take; sessions are admitted by what it holds "
                        "(default 0: all the GPU has free beside 5 GiB; on a CPU every session's full context)")
    p.add_argument("--mimi-decoder", choices=MIMI_DECODER_CHOICES,
                   help=f"Mimi's streaming decoder on a GPU: bf16 through its Triton kernels is ~2 ms a tick "
                        f"faster at 250 sessions with every token unchanged (its audio 37.7 dB from float32's "
                        f"without the kernels, 43.4 dB from that with them; docs/fidelity.md); float32 computes it "
                        f"as the reference does; the CPU is always float32 (default {d.mimi_decoder})")
    p.add_argument("--stun-url", help="STUN server for WebRTC, e.g. stun:stun.example.org:3478 (default: none)")
    p.add_argument("--turn-url", help="TURN server for WebRTC, e.g. turn:turn.example.org:3478?transport=udp")
    p.add_argument("--turn-username", help="user name for the TURN server (with --turn-url)")
    p.add_argument("--turn-credential", help="password for the TURN server (with --turn-url); browsers get it from "
                                             "/v1/realtime/webrtc-config, which needs an API key when keys are set")
    p.add_argument("--ice-relay-only", action="store_true", default=None, help="relay all WebRTC media via TURN")
    p.add_argument("--webrtc-red", action=argparse.BooleanOptionalAction, default=None,
                   help="with a WebRTC caller that offers RED (browsers do), carry each Opus packet again in the next "
                        "one, both ways: a lost packet comes back whole, at twice the audio bit rate (default on)")
    p.add_argument("--ice-connect-timeout-s", type=float,
                   help=f"a WebRTC call whose ICE and DTLS are not up this long after the answer ends "
                        f"(default {d.ice_connect_timeout_s:g})")
    p.add_argument("--max-message-bytes", type=int, help=f"largest WebSocket message (default {d.max_message_bytes})")
    p.add_argument("--first-message-timeout-s", type=float,
                   help=f"a connection (WebSocket, AudioSocket) whose first message has not come this long after "
                        f"it opens is closed (default {d.first_message_timeout_s:g})")
    p.add_argument("--idle-timeout-s", type=float,
                   help=f"a session whose client has sent nothing this long ends; a Realtime session may set its own "
                        f"(default {d.idle_timeout_s:g})")
    p.add_argument("--max-events-per-s", type=float,
                   help=f"client events per second per connection, with a burst of 2 s worth; more are dropped, "
                        f"with an error "
                        f"(default {d.max_events_per_s:g})")
    p.add_argument("--max-realtime-backlog-s", type=float,
                   help=f"audio a real-time WebSocket session may queue ahead of the engine, in seconds; more is "
                        f"refused, since it would only add latency (default {d.max_realtime_backlog_s:g})")
    p.add_argument("--max-input-backlog-s", type=float,
                   help=f"audio an input-paced session may queue ahead of the engine before it is told to slow "
                        f"down, in seconds (default {d.max_input_backlog_s:g})")
    p.add_argument("--max-output-backlog-s", type=float,
                   help=f"the model's output queued for a client that does not read, in seconds, before the "
                        f"session is closed (default {d.max_output_backlog_s:g})")
    p.add_argument("--shutdown-timeout-s", type=float,
                   help=f"the final close: how long open sessions get for session.closed and the close handshake "
                        f"(default {d.shutdown_timeout_s:g})")
    p.add_argument("--drain-timeout-s", type=float,
                   help=f"on SIGTERM stop admitting and let live sessions run this long before the final close; a "
                        f"second SIGTERM closes at once (default {d.drain_timeout_s:g})")
    p.add_argument("--agent-port", type=int,
                   help="TCP port answering HAProxy's agent-check with the free-slot weight, drain or down "
                        "(default: off)")
    p.add_argument("--gpus",
                   help="one engine process per GPU under one server: all, or indices such as 0,1 (devices such as "
                        "cpu,cpu are taken as they are); new sessions go to the engine with the most free slots "
                        "(default: one engine on --device)")
    p.add_argument("--workers", type=int,
                   help="worker processes for the network and media work, sharing the port, beside one engine process "
                        "that owns the GPU; 0 runs everything in one process (default: half the cores, 1 to 16)")
    p.add_argument("--input-lead-ms", type=float,
                   help=f"workers send each tick's input frames this long before its deadline (default "
                        f"{d.input_lead_ms:g})")
    p.add_argument("--max-output-bytes", type=int, help=f"unread output per session (default {d.max_output_bytes})")
    p.add_argument("--max-connections-per-ip", type=int,
                   help=f"open connections per client address, 0 = no limit (default {d.max_connections_per_ip})")
    p.add_argument("--audiosocket-port", type=int,
                   help="TCP port for Asterisk AudioSocket calls, on --host (default: off)")
    p.add_argument("--engine-stalled-s", type=float,
                   help=f"/health reports the engine down (503) after this long without a tick "
                        f"(default {d.engine_stalled_s:g})")
    p.add_argument("--engine-warm-lead-ms", type=float,
                   help=f"the engine wakes this long before each tick to make its first host calls once, so the tick "
                        f"finds them warm; 0: off (default {d.engine_warm_lead_ms:g})")
    p.add_argument("--sip-port", type=int, help="SIP user agent server port, UDP and TCP (default: off)")
    p.add_argument("--sip-address", help="the address SDP and Contact advertise (default: the bind address, or the "
                                         "local address towards each caller when bound to all)")
    p.add_argument("--rtp-ports", help=f"RTP/RTCP port range FIRST-LAST (default {d.rtp_ports})")
    p.add_argument("--sip-agent", action="append", dest="sip_agents",
                   help="NAME=voice,persona-file: calls to sip:NAME@... get this voice and persona (repeat; an agent "
                        "named 'default' takes other users; without agents every call gets the default voice)")
    p.add_argument("--sip-allow", action="append", help="source CIDR allowed to call (repeat; default: any)")
    p.add_argument("--sip-user", help="digest authentication user (with --sip-password)")
    p.add_argument("--sip-password", help="digest authentication password (with --sip-user)")
    p.add_argument("--sip-realm", help=f"digest realm (default {d.sip_realm})")
    p.add_argument("--sip-x-headers", action="store_true", default=None,
                   help="let callers choose persona and voice with X-Persona / X-Voice headers")
    p.add_argument("--sip-own-worker", action=argparse.BooleanOptionalAction, default=None,
                   help="with --sip-port and --workers >= 2, worker 0 serves the SIP door alone and takes no HTTP or "
                        "WebSocket sessions: every SIP call's media runs in the door's worker, which with its share "
                        "of the port besides was the one to fall behind at full load (default on)")
    p.add_argument("--record-dir",
                   help="record calls here: per call a stereo Ogg Opus file (caller left, agent right), "
                        "transcript.jsonl and call.json, under DIR/<UTC date>/<call id>/ (default: off)")
    p.add_argument("--record-policy", choices=RECORD_POLICIES,
                   help="with --record-dir: all records every call; opt-out every call whose session or agent does "
                        "not say record=false; opt-in only those that say record=true (default all)")
    p.add_argument("--spool-dir",
                   help="where undelivered webhooks and the markers of live calls are kept, so that they survive a "
                        "crash (default: CACHE_DIR/spool-PORT; give each server on a host its own)")
    p.add_argument("--webhook-url", help="POST call.started and call.ended events here, signed (default: off)")
    p.add_argument("--webhook-secret", help="the HMAC-SHA256 key that signs each webhook (needed with --webhook-url)")
    p.add_argument("--webhook-retry-s", type=float,
                   help=f"retry an undelivered webhook this long, then give it up (default {d.webhook_retry_s:g})")
    p.add_argument("--webhook-backoff-max-s", type=float,
                   help=f"the longest wait between two tries of a webhook; the waits double from 1 s up to it "
                        f"(default {d.webhook_backoff_max_s:g})")
    p.add_argument("--admin-key",
                   help="the key of the admin API (GET /v1/calls, DELETE /v1/calls/ID); must differ from every "
                        "--api-key (default: the admin API is off)")
    return p


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Flags from `argv`, then `PERSONAPLEX_<FLAG>` from `env`, then the defaults."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(argv))
    s = Settings()
    for name, default in vars(Settings()).items():
        value = args.get(name)
        if value is None:
            raw = env.get(_ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            value = raw
        try:
            setattr(s, name, _coerce(name, value, default))
        except ValueError:
            kind = "an integer" if isinstance(default, int) else "a number"
            raise SystemExit(f"{_names(name)} takes {kind}, got {value!r}") from None
        bound = BOUNDS.get(name)
        if bound is not None and not bound.admits(getattr(s, name)):
            raise SystemExit(f"{_names(name)} must be {bound}, got {value:g}" if isinstance(value, float) else
                             f"{_names(name)} must be {bound}, got {value}")
    for name, choices in CHOICES.items():
        if getattr(s, name) not in choices:
            raise SystemExit(f"{_names(name)} must be one of {', '.join(choices)}, got {getattr(s, name)!r}")
    try:
        rtp_port_range(s.rtp_ports)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    _check_calls(s)
    check_model_name(s.model)
    if s.workers < 0:
        s.workers = default_workers()
    if s.gpus and s.workers == 0:
        raise SystemExit("--gpus runs one engine process per GPU beside worker processes: it needs --workers >= 1")
    return s


def rtp_port_range(spec: str) -> tuple[int, int]:
    """`--rtp-ports FIRST-LAST` as (first, last); ValueError, in words, for anything else."""
    try:
        first, last = (int(p) for p in spec.split("-", 1))
    except ValueError:
        raise ValueError(f"--rtp-ports takes FIRST-LAST, got {spec!r}") from None
    if not 1024 <= first < last <= 65535:
        raise ValueError(f"--rtp-ports {spec!r}: need 1024 <= FIRST < LAST <= 65535")
    return first, last


def _names(name: str) -> str:
    """A setting as the user spells it: `--max-sessions / PERSONAPLEX_MAX_SESSIONS`."""
    return f"--{name.replace('_', '-')} / {_ENV_PREFIX}{name.upper()}"


def _check_calls(s: Settings) -> None:
    """Recording, webhook and admin flags, each refused in one line."""
    for flag, folder in (("--record-dir", s.record_dir), ("--spool-dir", s.spool_dir)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise SystemExit(f"{flag} {folder}: not a folder")
    if s.webhook_url:
        if urlsplit(s.webhook_url).scheme not in ("http", "https") or not urlsplit(s.webhook_url).netloc:
            raise SystemExit(f"--webhook-url must be an http:// or https:// URL, got {s.webhook_url!r}")
        if not s.webhook_secret:
            raise SystemExit("--webhook-url needs --webhook-secret (every event is signed with it)")
    if s.admin_key and s.admin_key in s.api_keys:
        raise SystemExit("--admin-key must differ from every --api-key (a client must never hold the admin key)")


def default_workers(cores: int | None = None) -> int:
    """Half the cores for the doors (the engine process and the load beside it keep the rest), 1 to 16."""
    cores = cores or os.cpu_count() or 2
    return max(1, min(16, cores // 2))


def _coerce(name: str, value: object, default: object) -> object:
    if name == "sip_agents":  # each holds a comma itself: the environment list is split on ";"
        return tuple(a.strip() for a in value.split(";") if a.strip()) if isinstance(value, str) else tuple(value)
    if isinstance(default, tuple):
        if isinstance(value, str):
            return split_csv(value)
        return tuple(v for item in value for v in split_csv(item))  # type: ignore[union-attr]
    if name in ("voices_dir", "cache_dir", "record_dir", "spool_dir"):
        return Path(str(value)).expanduser()
    if isinstance(default, bool):
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)  # type: ignore[arg-type]
    if isinstance(default, float):
        return float(value)  # type: ignore[arg-type]
    return str(value)
