from monarch._src.job.job import JobTrait

class KubeConfig:
    @staticmethod
    def from_path(path: str) -> KubeConfig: ...

class ImageSpec:
    def __init__(self, image: str, resources: dict[str, object] | None = None) -> None: ...

class KubernetesJob(JobTrait):
    def add_mesh(self, name: str, **kwargs: object) -> None: ...  # num_replicas, image_spec, ... (0.6.0)
