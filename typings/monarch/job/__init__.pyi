from collections.abc import Mapping

from monarch._src.job.job import JobState as JobState
from monarch._src.job.job import JobTrait as JobTrait
from monarch._src.job.job import LocalJob as LocalJob
from monarch._src.job.job import ProcessJob as ProcessJob

class SlurmJob(JobTrait):
    def __init__(self, meshes: Mapping[str, int], **kwargs: object) -> None: ...
