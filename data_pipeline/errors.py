"""The one error type every data problem raises.

A bad shard, file or setting must stop a run with a single readable line that names the
culprit (``shard-train-000003.tar: token id 70000 >= vocab size 512``), not a traceback
from deep inside tarfile, numpy or sentencepiece.
"""


from ascender_dist.config.errors import UserError


class DataError(UserError, ValueError):
    """A data file, shard or data setting is unusable. ``str(e)`` is one line naming what and why."""

    def __init__(self, where: str, problem: str):
        self.where = str(where)
        self.problem = " ".join(str(problem).split())  # one line, whatever the cause text held
        super().__init__(f"{self.where}: {self.problem}" if self.where else self.problem)

    def __reduce__(self):
        """Pickle as (where, problem), so an error raised in a worker process arrives intact."""
        return type(self), (self.where, self.problem)
