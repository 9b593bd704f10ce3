"""A session's sampling settings as plain values: no torch here, so processes without the model can import them
(model/sampling.py turns them into per-row tensors)."""

from __future__ import annotations

from dataclasses import dataclass

# The largest top-k a session may ask for: the step's sampling takes this many candidates of every row at once.
MAX_TOP_K_TEXT = 500
MAX_TOP_K_AUDIO = 2048


@dataclass(frozen=True)
class SamplingParams:
    """A session's sampling settings; the defaults are the reference server's."""

    greedy: bool = False
    temp_text: float = 0.7
    topk_text: int = 25
    temp_audio: float = 0.8
    topk_audio: int = 250
    seed: int | None = None

    def validate(self, max_top_k_text: int, max_top_k_audio: int) -> None:
        """Raise ValueError naming the first bad field."""
        checks = (
            ("temp_text", 0.0 <= self.temp_text <= 10.0, "a temperature in [0, 10]"),
            ("temp_audio", 0.0 <= self.temp_audio <= 10.0, "a temperature in [0, 10]"),
            ("topk_text", 1 <= self.topk_text <= max_top_k_text, f"an integer in [1, {max_top_k_text}]"),
            ("topk_audio", 1 <= self.topk_audio <= max_top_k_audio, f"an integer in [1, {max_top_k_audio}]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "a non-negative integer"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"sampling '{name}' must be {what}, got {getattr(self, name)!r}")
