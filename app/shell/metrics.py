"""Server counters and their Prometheus text exposition (format 0.0.4), written by hand.

The app counts admissions, rejections, errors and connections; the engine's `EngineStats` gives ticks and the tick
histogram; frame and underrun totals are closed conversations' counts plus the live ones' current counts. With
worker processes, each worker's counters reach the others through the engine process (`snapshot()`, about twice a
second), and whichever worker serves `/metrics` renders the sum: its own counters now, the others' last snapshots.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.shell.loop_lag import LoopLag, collector_report
from model.engine.channel import WorkerCounterSet

_QUANTILES = {"p50": "0.5", "p99": "0.99", "max": "1"}
_KEY_JOIN = "\t"  # joins a rejection's route and code into one key of a snapshot


class CountedConversation(Protocol):
    def counters(self) -> dict[str, int]: ...   # frames_in, frames_out, underruns


@dataclass(frozen=True)
class _Family:
    name: str
    kind: str
    help: str


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


class Metrics:
    """Counters kept on the event loop thread; `render()` reads the engine and live conversations."""

    def __init__(self) -> None:
        self.admissions: Counter[str] = Counter()                # route
        self.rejections: Counter[tuple[str, str]] = Counter()    # (route, code)
        self.errors: Counter[str] = Counter()                    # code sent to a client
        self.connections: Counter[str] = Counter()               # route, open sockets now
        self.dtmf: Counter[str] = Counter()                      # route, telephone key presses received
        self.closed_totals: Counter[str] = Counter()             # frames_in/frames_out/underruns of closed sessions
        self.sip: Counter[str] = Counter()                       # SIP door events: malformed, oversized, rtp drops...
        self.recordings: Counter[str] = Counter()                # app/calls/recording.py (its writer thread adds)
        self.webhooks: Counter[str] = Counter()                  # app/calls/webhooks.py: events by result
        self.live: set[CountedConversation] = set()
        self.loop_lag = LoopLag()

    def conversation_opened(self, conv: CountedConversation) -> None:
        self.live.add(conv)

    def conversation_closed(self, conv: CountedConversation) -> None:
        if conv in self.live:
            self.live.discard(conv)
            self.closed_totals.update(conv.counters())

    def frame_totals(self) -> Counter[str]:
        totals = Counter(self.closed_totals)
        for conv in self.live:
            totals.update(conv.counters())
        return totals

    def snapshot(self) -> WorkerCounterSet:
        """These counters as plain dicts, to cross to other processes (`render(..., others=[...])`)."""
        return {"admissions": dict(self.admissions), "errors": dict(self.errors),
                "connections": dict(self.connections), "frames": dict(self.frame_totals()),
                "dtmf": dict(self.dtmf), "sip": dict(self.sip), "recordings": dict(self.recordings),
                "webhooks": dict(self.webhooks),
                "loop_lag_ms": self.loop_lag.quantiles(), "loop_stalls": self.loop_lag.stall_sites(),
                "loop_stalls_at": self.loop_lag.stall_times(), "gc": collector_report(),
                "rejections": {f"{route}{_KEY_JOIN}{code}": n for (route, code), n in self.rejections.items()}}

    def render(self, engine_stats: Any | None, others: Mapping[str, WorkerCounterSet] | None = None,
               name: str = "main", engines: Sequence[Any] = ()) -> str:
        """The exposition; `others` are the other worker processes' snapshots by name, `name` is this process's;
        `engine_stats` are the engines' totals and `engines` each engine process's view (model.engine.pool)."""
        others = others or {}
        out: list[str] = []
        admissions, errors, connections = Counter(self.admissions), Counter(self.errors), Counter(self.connections)
        rejections, totals = Counter(self.rejections), self.frame_totals()
        dtmf, sip = Counter(self.dtmf), Counter(self.sip)
        recordings, webhooks = Counter(dict(self.recordings)), Counter(dict(self.webhooks))
        for other in others.values():
            sip.update(other.get("sip", {}))
            recordings.update(other.get("recordings", {}))
            webhooks.update(other.get("webhooks", {}))
            admissions.update(other.get("admissions", {}))
            errors.update(other.get("errors", {}))
            connections.update(other.get("connections", {}))
            dtmf.update(other.get("dtmf", {}))
            totals.update(other.get("frames", {}))
            rejections.update({tuple(key.split(_KEY_JOIN, 1)): n for key, n in other.get("rejections", {}).items()})

        def family(name: str, kind: str, help_: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
            rows = list(samples)
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in rows:
                out.append(f"{name}{suffix}{_label_text(labels)} {_num(value)}")

        family("personaplex_admissions_total", "counter", "Conversations admitted, by route.",
               (("", {"route": r}, n) for r, n in sorted(admissions.items())))
        family("personaplex_rejections_total", "counter", "Connections refused, by route and error code.",
               (("", {"route": r, "code": c}, n) for (r, c), n in sorted(rejections.items())))
        family("personaplex_errors_total", "counter", "Error events sent to clients, by code.",
               (("", {"code": c}, n) for c, n in sorted(errors.items())))
        family("personaplex_connections", "gauge", "Open WebSocket connections, by route.",
               (("", {"route": r}, n) for r, n in sorted(connections.items())))
        family("personaplex_dtmf_total", "counter", "Telephone key presses received, by route.",
               (("", {"route": r}, n) for r, n in sorted(dtmf.items())))
        family("personaplex_sip_events_total", "counter",
               "SIP door events: malformed or oversized messages, refused INVITEs, RTP packets dropped (by reason).",
               (("", {"event": e}, n) for e, n in sorted(sip.items())))
        family("personaplex_recordings_total", "counter",
               "Call recordings, by result: started, written (finished whole), failed (the disk refused; the call "
               "went on).", (("", {"result": r}, recordings[f"recordings_{r}"])
                             for r in ("started", "written", "failed")))
        family("personaplex_recording_bytes_total", "counter", "Bytes of the call recordings written whole.",
               [("", {}, recordings["recording_bytes"])])
        family("personaplex_recording_dropped_frames_total", "counter",
               "Frames the recording writer could not take in time (silence in the file in their place).",
               [("", {}, recordings["recording_dropped_frames"])])
        family("personaplex_webhooks_total", "counter",
               "Webhook events by result: delivered, retried (a try failed), refused (4xx), given_up (retry time "
               "over), overflowed (queue full).",
               (("", {"result": k.removeprefix("webhooks_")}, n) for k, n in sorted(webhooks.items())))
        family("personaplex_frames_in_total", "counter", "80 ms input frames the engine consumed.",
               [("", {}, totals["frames_in"])])
        family("personaplex_frames_out_total", "counter", "80 ms output frames the engine produced.",
               [("", {}, totals["frames_out"])])
        family("personaplex_underruns_total", "counter", "Ticks where a conversation had no input and got silence.",
               [("", {}, totals["underruns"])])
        lags = [("", {"process": name, "quantile": _QUANTILES[q]}, v) for q, v in self.loop_lag.quantiles().items()]
        for other_name, other in sorted(others.items()):
            lags += [("", {"process": other_name, "quantile": _QUANTILES[q]}, v)
                     for q, v in other.get("loop_lag_ms", {}).items()]
        family("personaplex_event_loop_lag_ms", "gauge",
               "How late each door process's event loop woke, over the last minute.", lags)
        if engine_stats is not None:
            self._render_engine(family, engine_stats)
        if engines:
            self._render_each_engine(family, engines)
        return "\n".join(out) + "\n"

    @staticmethod
    def _render_each_engine(family: Any, engines: Sequence[Any]) -> None:
        def each(field: str) -> list[tuple[str, dict[str, str], float]]:
            return [("", {"engine": str(v.index)}, getattr(v.stats, field)) for v in engines if v.stats is not None]

        family("personaplex_engine_up", "gauge",
               "1 while an engine process is up: connected, its tick loop running (at idle too); 0 while it is gone "
               "or stalled, by engine.",
               [("", {"engine": str(v.index), "device": v.device}, int(v.running)) for v in engines])
        family("personaplex_engine_sessions_in_use", "gauge", "Conversation slots in use, by engine.",
               each("sessions_in_use"))
        family("personaplex_engine_sessions_max", "gauge", "Conversation slots in all, by engine.",
               each("max_sessions"))
        family("personaplex_engine_tick_p99_ms", "gauge", "Tick duration p99 over a recent window, by engine.",
               each("tick_ms_p99"))
        family("personaplex_engine_late_ticks_by_engine_total", "counter", "Ticks that overran 80 ms, by engine.",
               each("late_ticks"))

    @staticmethod
    def _render_engine(family: Any, s: Any) -> None:
        family("personaplex_sessions_in_use", "gauge", "Conversation slots in use.", [("", {}, s.sessions_in_use)])
        family("personaplex_sessions_max", "gauge", "Conversation slots in all.", [("", {}, s.max_sessions)])
        family("personaplex_engine_ticks_total", "counter", "Engine ticks run.", [("", {}, s.ticks)])
        family("personaplex_engine_late_ticks_total", "counter", "Ticks that overran their 80 ms budget.",
               [("", {}, s.late_ticks)])
        family("personaplex_engine_batch", "gauge", "Conversations stepped in the last tick.", [("", {}, s.batch)])
        family("personaplex_engine_gc_collections_total", "counter",
               "Garbage collections the engine thread ran between ticks.", [("", {}, s.gc_collections)])
        family("personaplex_engine_gc_max_ms", "gauge",
               "The longest of them (it holds the GIL: a tick's outputs wait for it).", [("", {}, s.gc_ms_max)])
        family("personaplex_engine_input_frames_staged_total", "counter",
               "Input frames the engine process wrote into their rows as they arrived, off the tick's path.",
               [("", {}, s.input_frames_staged)])
        family("personaplex_engine_frames_dispatch_ms", "gauge",
               "The engine process's time on each worker's input frames message, over the recent ones: its event "
               "loop shares the GIL with the tick, and a tick's frames must be in before its reads begin.",
               [("", {"quantile": _QUANTILES[q]}, v) for q, v in s.frames_dispatch_ms.items()])
        family("personaplex_engine_tick_last_ms", "gauge", "Duration of the last tick.", [("", {}, s.tick_ms)])
        family("personaplex_engine_tick_quantile_ms", "gauge", "Tick duration quantiles over a recent window.",
               [("", {"quantile": "0.5"}, s.tick_ms_p50), ("", {"quantile": "0.99"}, s.tick_ms_p99)])
        family("personaplex_engine_part_ms", "gauge", "Duration of each part of the last tick.",
               (("", {"part": p}, v) for p, v in sorted(s.parts_ms.items())))
        family("personaplex_engine_host_ms", "gauge",
               "Host work of the last tick outside the device step (prepare: inputs and launches; deliver: outputs; "
               "hand_off: after the tick, its outputs handed to the worker processes).",
               (("", {"phase": p}, v) for p, v in sorted(s.host_ms.items())))
        buckets = list(s.tick_ms_buckets)
        rows = [("_bucket", {"le": _num(le)}, n) for le, n in buckets]
        count = buckets[-1][1] if buckets else 0
        if not buckets or buckets[-1][0] != float("inf"):
            rows.append(("_bucket", {"le": "+Inf"}, s.ticks))
            count = s.ticks
        total = getattr(s, "tick_ms_sum", None)
        if total is not None:
            rows.append(("_sum", {}, total))
        rows.append(("_count", {}, count))
        family("personaplex_engine_tick_ms", "histogram", "Engine tick duration in milliseconds.", rows)
        family("personaplex_engine_errors_total", "counter",
               "Conversations the engine failed, and loop passes that raised, by cause.",
               (("", {"cause": c}, n) for c, n in sorted(s.errors_by_cause.items())))
        family("personaplex_engine_prompt_cache_total", "counter", "Session starts by prompt-cache result.",
               [("", {"result": "hit"}, s.prompt_cache_hits), ("", {"result": "miss"}, s.prompt_cache_misses)])
        family("personaplex_engine_kv_pages", "gauge", "Pages of the KV page pool, by state.",
               [("", {"state": "free"}, s.kv_pages_free), ("", {"state": "used"}, s.kv_pages - s.kv_pages_free)])
        family("personaplex_engine_kv_window_changes_total", "counter",
               "Context windows the KV page pool shrank under pressure, and grew back once pages freed.",
               [("", {"change": "shrink"}, s.kv_window_shrinks), ("", {"change": "grow"}, s.kv_window_grows)])
        family("personaplex_engine_kv_refused_total", "counter",
               "Sessions refused because the free KV pages would not cover the live sessions' growth.",
               [("", {}, s.kv_refused)])
        family("personaplex_engine_prompt_copies_in_flight_total", "counter",
               "Cached prompts copied into their slots while a tick ran on the device (the open did not wait for it).",
               [("", {}, s.prompt_copies_in_flight)])
        family("personaplex_engine_open_work_last_ms", "gauge",
               "Engine-thread time of the last session start (its prompt; an input-clocked one's first model half).",
               [("", {}, s.open_work_ms_last)])
        family("personaplex_engine_session_start_ms", "gauge",
               "Recent session starts: from the request to the session live, and to its first frame (quantiles).",
               [("", {"until": until, "quantile": _QUANTILES[q]}, v)
                for until, values in (("live", s.start_ms), ("first_frame", s.first_frame_ms))
                for q, v in values.items()])
        family("personaplex_engine_open_step_ms", "gauge",
               "Recent duration of one session-start step, by kind; a step runs where it fits between ticks.",
               (("", {"kind": k}, v) for k, v in sorted(s.open_step_ms.items())))
