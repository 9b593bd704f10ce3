"""Helpers for the SIP door's tests: free ports, a real baresip phone (headless), and reading its recordings.

baresip (Debian's `baresip-core`) runs with a config folder of its own: aufile plays a WAV as the microphone, the
ALSA null device is the speaker, and the sndfile module records what it hears (`-dec.wav`) and sends (`-enc.wav`).
`-t N` hangs up (BYE) after N seconds and exits; `-e '/dial URI'` places the call at start (spec/telephony.md §6).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import wave
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.server_support import start_on_free_ports

BARESIP = shutil.which("baresip")
MODULES = Path("/usr/lib/baresip/modules")


def free_port(pair: bool = False) -> int:
    """A port free for UDP and TCP (and, with `pair`, an even one whose next port is free for both too: an RTP and
    RTCP pair, or baresip's SIP port, whose next it always takes for TLS)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", 0))
            port = u.getsockname()[1]
            if pair and port % 2:
                continue
            try:
                for candidate in (port, port + 1) if pair else (port,):
                    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                        if (candidate, kind) == (port, socket.SOCK_DGRAM):
                            continue  # held by `u`, just bound
                        with socket.socket(socket.AF_INET, kind) as other:
                            other.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


async def start_sip_server(start_server: Callable[..., Awaitable[Any]], **overrides: Any) -> Any:
    """`start_server(**overrides)` with the SIP door on a free port and RTP on free ports after it."""
    def ports() -> dict[str, Any]:
        base = free_port(pair=True)
        return {"sip_port": free_port(), "rtp_ports": f"{base}-{base + 40}"}
    return await start_on_free_ports(start_server, ports, **overrides)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    pcm = np.clip(np.rint(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def read_wav(path: Path) -> tuple[np.ndarray, int, int]:
    """(mono float32 samples, rate, channels) of a 16-bit WAV (channels averaged)."""
    with wave.open(str(path), "rb") as w:
        rate, channels = w.getframerate(), w.getnchannels()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return pcm.reshape(-1, channels).mean(axis=1), rate, channels


@dataclass
class BaresipResult:
    returncode: int
    log: str
    heard: Path | None        # the -dec.wav: what the phone heard
    sent: Path | None


async def baresip_call(folder: Path, uri: str, *, seconds: float, codec: str = "PCMU/8000/1", tone_hz: float = 440.0,
                       sip_port: int | None = None, rtp_port: int | None = None, password: str | None = None,
                       commands: tuple[str, ...] = ()) -> BaresipResult:
    """Call `uri` from a fresh baresip, play a tone for the whole call, hang up after `seconds`; its recordings."""
    assert BARESIP is not None
    folder.mkdir(parents=True, exist_ok=True)
    rec = folder / "rec"
    rec.mkdir(exist_ok=True)
    rate = int(codec.split("/")[1]) if not codec.lower().startswith("opus") else 48000
    src_rate = 8000 if rate == 8000 else 16000
    t = np.arange(int(src_rate * (seconds + 5))) / src_rate
    write_wav(folder / "source.wav", 0.3 * np.sin(2 * np.pi * tone_hz * t), src_rate)
    sip_port = sip_port or free_port(pair=True)  # baresip listens for TLS on the next port
    rtp_port = rtp_port or free_port(pair=True)
    modules = "\n".join(f"module\t\t\t{m}" for m in ("g711.so", "g722.so", "opus.so", "aufile.so", "sndfile.so",
                                                      "alsa.so"))
    (folder / "config").write_text(f"""poll_method\t\tepoll
sip_listen\t\t127.0.0.1:{sip_port}
net_interface\t\t127.0.0.1
call_local_timeout\t120
call_max_calls\t\t4
audio_buffer\t\t20-160
audio_source\t\taufile,{folder / 'source.wav'}
audio_player\t\talsa,null
audio_alert\t\talsa,null
ausrc_srate\t\t{src_rate}
ausrc_channels\t\t1
auplay_srate\t\t{src_rate}
auplay_channels\t\t1
rtp_ports\t\t{rtp_port}-{rtp_port + 9}
rtcp_mux\t\tno
jitter_buffer_delay\t1-10
statmode_default\toff
module_path\t\t{MODULES}
{modules}
module_tmp\t\taccount.so
module_app\t\tmenu.so
snd_path\t\t{rec}
""")
    auth = f";auth_pass={password}" if password else ""
    (folder / "accounts").write_text(f"<sip:caller@127.0.0.1:{sip_port}>;regint=0{auth};audio_codecs={codec}\n")
    args = ["-4", "-f", str(folder), "-t", str(int(seconds)), "-e", f"/dial {uri}"]
    for command in commands:
        args += ["-e", command]
    proc = await asyncio.create_subprocess_exec(BARESIP, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), seconds + 20)
    heard = sorted(rec.glob("*-dec.wav"))
    sent = sorted(rec.glob("*-enc.wav"))
    return BaresipResult(proc.returncode or 0, out.decode(errors="replace"), heard[-1] if heard else None,
                         sent[-1] if sent else None)
