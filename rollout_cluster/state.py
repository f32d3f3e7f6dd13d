from .router.state import *  # noqa: F401,F403  (a shim until the policies import router.state)
from .router.state import ClusterView, GroupState, ReplicaState, SeqState, SeqStatus, WorkQueue  # noqa: F401
