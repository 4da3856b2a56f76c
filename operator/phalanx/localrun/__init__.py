"""The same TrainingJob on this machine first (``phalanx run-local``, the SDK's local backend).

``start(job)`` runs the job's trainer command in ``workers.desired`` processes with the environment
the operator would give each worker pod (``environment``: what changes on one machine, and why),
next to the rendezvous store the operator would run (``runner``). It reads the API and the pure
planner only: no cluster is needed.
"""

from phalanx.localrun.environment import LocalPlan, LocalRunError, Machine, WorkerProcess
from phalanx.localrun.runner import LocalRun, plan, start

__all__ = ["LocalPlan", "LocalRun", "LocalRunError", "Machine", "WorkerProcess", "plan", "start"]
