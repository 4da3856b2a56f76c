"""Save now: a user (or a script) sets the job's ``phalanx.dev/save-now`` annotation to any token
(a timestamp, say), and the workers save a checkpoint at their next step boundary, without a restart.

Pure, like the rest of the planner: from the job's annotation, the previous ``status.saveNow``,
the newest checkpoint the workers reported and the job's worker pods.

- A new token (not the one ``status.saveNow.token`` holds) is taken: recorded with the time it was
  taken and the step of the newest checkpoint then (``afterStep``), in the status write that comes
  before any pod patch, so a token is taken once whatever happens to the operator in between. The
  same token again (the annotation left in place, a pass repeated) is a no-op.
- Until it is answered, the token goes onto every running worker pod of the current attempt that
  does not carry it yet (``pod_patches.save_now``: a guarded JSON patch of one annotation, never
  the spec). The workers read it from a downward-API file (``desired.pods``: mounted on the pods of
  a job with spec.checkpoint) that the kubelet rewrites, and save together (``worker.session``).
- It is answered by the first checkpoint the workers report (``status.lastCheckpoint``) that is
  past ``afterStep`` and that they say answers the token (``naming.CHECKPOINT_SAVE_NOW_METRIC``:
  no clock compared, so a save in the request's own second counts) or that was committed after the
  request (strictly: times are whole seconds, and a checkpoint of the same second might predate
  it): ``savedToken``, ``savedAt``, ``step``. Any such checkpoint answers it, a periodic one too: it
  holds every step up to the request.
- A value that is not a token (``observed.SAVE_NOW_TOKEN``) is ignored with a message that names
  the annotation; so is any token of a job without spec.checkpoint, whose workers have nowhere to save.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming, pod_patches
from phalanx.reconcile.observed import SAVE_NOW_TOKEN, PodRecord
from phalanx.reconcile.pod_patches import PodPatch
from phalanx.reconcile.status import TRAINING, format_time, parse_time

FIELD = f"metadata.annotations['{naming.SAVE_NOW_ANNOTATION}']"


def requested_token(job: api.TrainingJob) -> tuple[str | None, str | None]:
    """The token the job's annotation asks for, or why its value is ignored (None, None: no request)."""
    value = (job.metadata.annotations or {}).get(naming.SAVE_NOW_ANNOTATION)
    if value is None:
        return None, None
    if not SAVE_NOW_TOKEN.accepts(value):
        shown = value if len(value) <= SAVE_NOW_TOKEN.limit else value[: SAVE_NOW_TOKEN.limit] + "..."
        return None, f"{FIELD} {shown!r} is ignored: it must be {SAVE_NOW_TOKEN.what}"
    if job.spec.checkpoint is None:
        return None, f"{FIELD} is ignored: the job has no spec.checkpoint, so its workers have nowhere to save"
    return value, None


def answered(request: api.SaveNow, checkpoint: api.LastCheckpoint | None, answers: int | None = None) -> bool:
    """Whether ``checkpoint`` answers the pending request: its workers say it answers the token
    (``answers``, the key of the token they saved for), or it was committed after the request."""
    if checkpoint is None or request.requested_at is None or request.token is None:
        return False
    past = request.after_step is None or checkpoint.step > request.after_step
    if past and answers is not None and answers == naming.save_now_key(request.token):
        return True  # no clock compared: a save in the request's own second counts
    committed, requested = parse_time(checkpoint.time), parse_time(request.requested_at)
    return past and committed is not None and requested is not None and committed > requested


def save_now(
    job: api.TrainingJob,
    previous: api.TrainingJobStatus,
    checkpoint: api.LastCheckpoint | None,
    pods: Iterable[PodRecord],
    *,
    attempt: int,
    phase: api.Phase,
    now: datetime,
    answers: int | None = None,
) -> tuple[dict[str, Any] | None, tuple[PodPatch, ...]]:
    """The next ``status.saveNow`` (None: the one there stands) and the pod patches that carry a
    pending token. ``checkpoint``: the newest checkpoint, as this pass writes it; ``answers``: the
    key of the save-now token its workers say it answers (``WorkerProgress.checkpoint_save_now``)."""
    before = previous.save_now
    token, message = requested_token(job)
    request = before or api.SaveNow()
    if token is not None and token != request.token:
        last = previous.last_checkpoint
        request = request.model_copy(
            update={"token": token, "requested_at": format_time(now), "after_step": last.step if last else None}
        )
    request = request.model_copy(update={"message": message})
    if request.token is not None and request.saved_token != request.token and answered(request, checkpoint, answers):
        assert checkpoint is not None
        request = request.model_copy(
            update={"saved_token": request.token, "saved_at": checkpoint.time, "step": checkpoint.step}
        )
    patches: tuple[PodPatch, ...] = ()
    if token is not None and token == request.token and request.saved_token != token and phase in TRAINING:
        patches = tuple(
            pod_patches.save_now(pod.name, pod.uid, attempt, token)
            for pod in pods
            if pod.role == naming.ROLE_WORKER
            and pod.attempt == attempt
            and pod.phase == "Running"
            and not pod.deleting
            and pod.uid
            and pod.save_now != token
        )
    if request == (before or api.SaveNow()):
        return None, patches
    body = request.model_dump(by_alias=True, exclude_none=True)
    if before is not None:  # a merge patch: fields the new value lacks are removed by null
        body = {**dict.fromkeys(before.model_dump(by_alias=True, exclude_none=True)), **body}
    return body, patches
