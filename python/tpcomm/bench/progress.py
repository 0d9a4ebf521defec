"""Progress of a tpcomm.bench run: a tqdm bar when tqdm is importable, else
a plain line every `interval_s` seconds. Only an enabled instance (rank 0)
prints anything."""
import sys
import time


class Progress:
    def __init__(self, total, enabled=True, desc="tpcomm.bench", interval_s=10.0, stream=None, use_tqdm=True):
        self.total = max(int(total), 1)
        self.done = 0
        self.enabled = enabled
        self.desc = desc
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.start = time.monotonic()
        self._last = self.start
        self._bar = None
        if enabled and use_tqdm:
            try:
                from tqdm import tqdm
            except Exception:  # noqa: BLE001 - no tqdm: plain lines
                tqdm = None
            if tqdm is not None:
                tty = hasattr(self.stream, "isatty") and self.stream.isatty()
                self._bar = tqdm(total=self.total, desc=desc, unit="run", file=self.stream, ascii=not tty,
                                 mininterval=0.5 if tty else 10.0, dynamic_ncols=tty)

    def advance(self, n=1, what=""):
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s or self.done == self.total:
            self._last = now
            print(self.line(what, now), file=self.stream, flush=True)

    def line(self, what="", now=None):
        now = time.monotonic() if now is None else now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta = f", ~{left:.0f} s left" if self.done else ""
        tail = f": {what}" if what else ""
        return f"[{self.desc}] {self.done}/{self.total} ({100.0 * self.done / self.total:.0f}%), " \
               f"{elapsed:.0f} s{eta}{tail}"

    def write(self, text):
        """Prints a message without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
