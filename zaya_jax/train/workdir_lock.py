"""One trainer per workdir: an exclusive lock (fcntl.flock) on WORKDIR/.lock, held until close.

The lock file records the holder as `host pid` and is removed when the trainer closes (a clean
finish leaves no `.lock`). The operating system drops the lock when the holding process ends,
however it ends (SIGKILL included), so a stale file never blocks a restart. Removing the file
while others may open it is safe because a taker checks, once it holds the lock, that the path
still names the file it locked (else it takes the new one). A multi-process job takes it on process 0 only. flock is advisory and local to one
machine on some network filesystems (NFS without lock support): there it guards only against a
second trainer on the same host.
"""

from __future__ import annotations

import fcntl
import os
import socket

from zaya_jax.errors import UserError

LOCK_FILE = ".lock"


class WorkdirLock:
    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        while True:
            try:
                self._file = open(self.path, "a+")  # pylint: disable=consider-using-with
            except OSError as e:
                raise UserError(f"workdir {workdir} is not writable: {e.strerror} (errno {e.errno}); "
                                "fix its permissions or choose another --workdir") from None
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.seek(0)
                holder = self._file.read().strip() or "unknown"
                self._file.close()
                raise UserError(f"workdir {workdir} is in use by another trainer (host pid: {holder}, lock "
                                f"{self.path}); stop it or choose another --workdir") from None
            if self._names_the_locked_file():
                break
            self._file.close()  # its holder removed it as we opened it: take the path's new file
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{socket.gethostname()} {os.getpid()}\n")
        self._file.flush()

    def _names_the_locked_file(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Removes the lock file, then drops the lock (in this order: see the module docstring)."""
        if not self._file.closed:
            if self._names_the_locked_file():
                os.remove(self.path)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
