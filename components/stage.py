"""KFP component `stage-weights`: S3 prefix → FSx for Lustre mount path, verified and published atomically."""

from kfp import dsl
from kfp.dsl import Model, Output

from components.image import STEP_IMAGE
from components.params import documented


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
@documented  # Args: section from components.params.PARAM_DOCS (KFP UI descriptions)
def stage_weights(
    source_uri: str,
    fsx_root: str,
    model_name: str,
    s3_endpoint_url: str,
    model: Output[Model],
):
    """Copy `source_uri` (s3://bucket/prefix) to `<fsx_root>/models/<model_name>`; credentials come from env."""
    from runtime.usecases.stage import StageRequest, stage

    model.metadata.update(stage(StageRequest(source_uri=source_uri, fsx_root=fsx_root, model_name=model_name,
                                             s3_endpoint_url=s3_endpoint_url)).metadata())
