"""Stop conditions and the streamed text of one request.

`StopChecker` holds the rules (stop token ids, eos, stop strings, min/max tokens); `TextStream`
combines it with an `IncrementalDetokenizer` so that the engine (offline generate) and the
router's streaming path produce the same text: `push(token_id) -> (delta, finished, reason)`.

OpenAI semantics: the matched stop string and everything after it are cut from the text; a stop
or eos token ends the request and contributes no text. While streaming, text that could be the
start of a stop string is held back, so a client never sees part of a stop sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class StopChecker:
    """Stop rules of one request. `num_output_tokens` always counts the new token."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens}")

    @classmethod
    def from_params(cls, params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> StopChecker:
        return cls(stop=params.stop, stop_token_ids=params.stop_token_ids,
                   eos_token_ids=tuple(eos_token_ids), ignore_eos=params.ignore_eos,
                   max_tokens=params.max_tokens, min_tokens=params.min_tokens)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def is_stop_token(self, token_id: int, num_output_tokens: int) -> bool:
        """True when this token ends the request as a stop (its text is then dropped)."""
        if num_output_tokens < self.min_tokens:
            return False
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and token_id in self.eos_token_ids

    def check_token(self, token_id: int, num_output_tokens: int) -> str | None:
        """Finish reason from the token alone: "stop", "length" or None. Stop wins over length.

        For engines that do not track text (no stop strings), this is the whole check.
        """
        if self.is_stop_token(token_id, num_output_tokens):
            return FINISH_STOP
        if num_output_tokens >= self.max_tokens:
            return FINISH_LENGTH
        return None

    def find_stop_string(self, text: str, num_new_chars: int,
                         num_output_tokens: int) -> tuple[int, str] | None:
        """Earliest stop string ending within the last `num_new_chars` of `text`.

        Returns (index where the kept text ends, the stop string) or None. Only the tail that
        can hold a new match is scanned: earlier text was checked when it arrived.
        """
        if not self.stop or num_new_chars <= 0 or num_output_tokens < self.min_tokens:
            return None
        best: tuple[int, str] | None = None
        for s in self.stop:
            # A match must end inside the new chars; older text never holds a fresh match.
            idx = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """Detokenizer + stop rules for one request; feed it every generated token in order."""

    def __init__(self, detokenizer: IncrementalDetokenizer, checker: StopChecker) -> None:
        self.detokenizer = detokenizer
        self.checker = checker
        self.text = ""  # output text so far, already trimmed at a stop string
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the matched stop string or stop token id
        self._sent = 0  # chars of `text` returned to the caller

    @classmethod
    def from_params(cls, tokenizer: Decoder, params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = (),
                    prompt_ids: list[int] | None = None) -> TextStream:
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        return cls(detok, StopChecker.from_params(params, eos_token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_id: int) -> tuple[str, bool, str | None]:
        """Account one generated token; return (text delta for the client, finished, reason)."""
        if self.finished:
            raise ValueError(f"token_id: stream already finished ({self.finish_reason})")
        self.num_output_tokens += 1
        n = self.num_output_tokens
        if self.checker.is_stop_token(token_id, n):
            self._finish(FINISH_STOP, int(token_id))
        else:
            self._append(self.detokenizer.add([int(token_id)]))
            if not self.finished and n >= self.checker.max_tokens:
                self._finish(FINISH_LENGTH, None)
        return self._release(), self.finished, self.finish_reason

    def push_many(self, token_ids: list[int]) -> tuple[str, bool, str | None]:
        """`push` each token until finished; tokens after the finishing one are ignored
        (`num_output_tokens` counts those taken). Without stop strings the tokens' text is
        decoded in one step: the same text, stop tokens and length limit as one by one."""
        if self.finished:
            raise ValueError(f"token_id: stream already finished ({self.finish_reason})")
        if self.checker.stop or len(token_ids) == 1:
            parts = []
            for tid in token_ids:
                parts.append(self.push(tid)[0])
                if self.finished:
                    break
            return "".join(parts), self.finished, self.finish_reason
        kept: list[int] = []
        finish: tuple[str, int | None] | None = None
        for tid in token_ids:
            self.num_output_tokens += 1
            n = self.num_output_tokens
            if self.checker.is_stop_token(tid, n):
                finish = (FINISH_STOP, int(tid))
                break
            kept.append(int(tid))
            if n >= self.checker.max_tokens:
                finish = (FINISH_LENGTH, None)
                break
        self._append(self.detokenizer.add(kept) if kept else "")
        if finish is not None:
            self._finish(*finish)
        return self._release(), self.finished, self.finish_reason

    def finish(self, reason: str = "abort") -> str:
        """End the stream from outside (abort, cancellation); return the remaining text."""
        if not self.finished:
            self._finish(reason, None)
        return self._release()

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        # Held-back partial characters become final; they may still complete a stop string.
        self._append(self.detokenizer.flush())
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def _append(self, delta: str) -> None:
        if not delta or self.finished:
            return
        self.text += delta
        hit = self.checker.find_stop_string(self.text, len(delta), self.num_output_tokens)
        if hit is not None:
            self.text = self.text[: hit[0]]
            self.finish_reason, self.stop_reason = FINISH_STOP, hit[1]

    def _release(self) -> str:
        end = len(self.text)
        if not self.finished:
            end = max(self._sent, end - self.checker.holdback(self.text))
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
