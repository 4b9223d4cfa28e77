"""Writes its PID to the file named by its argument, then sleeps (a conversion child that outlives
nothing: checkpoint.run_shielded's child must die with the rank that started it)."""

import os
import sys
import time

if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(60)
