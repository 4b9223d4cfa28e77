"""Run as ``python -m tests.helpers.signal_self``: sends itself SIGUSR1, then prints "survived"
(checkpoint.run_shielded's child: the signal must be ignored, as a scheduler's warning would be)."""

import os
import signal

if __name__ == "__main__":
    os.kill(os.getpid(), signal.SIGUSR1)
    print("survived")
