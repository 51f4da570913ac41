"""KFP component `promote`: champion DeploymentSpec → validated KServe + Kubernetes objects (applied on request)."""

from kfp import dsl
from kfp.dsl import Artifact, Output

from components.image import STEP_IMAGE
from components.params import documented


@dsl.component(base_image=STEP_IMAGE, install_kfp_package=False)
@documented  # Args: section from components.params.PARAM_DOCS (KFP UI descriptions)
def promote(
    champion_version: str,
    registered_model: str,
    mlflow_tracking_uri: str,
    namespace: str,
    image: str,
    pvc_name: str,
    apply: bool,
    kube_context: str,
    manifests: Output[Artifact],
    traffic_upload_uri: str = "",
):
    """Render the `champion` version's objects to `manifests` (YAML); apply them when `apply` is true.
    `traffic_upload_uri` (s3://bucket/prefix/, "" = off): the runtime records its traffic and ships it there."""
    from runtime.usecases.promote import PromoteRequest, promote

    manifests.metadata.update(promote(PromoteRequest(
        registered_model=registered_model, mlflow_tracking_uri=mlflow_tracking_uri, out_path=manifests.path,
        namespace=namespace, image=image, pvc_name=pvc_name, expect_version=champion_version, apply=apply,
        kube_context=kube_context, traffic_upload_uri=traffic_upload_uri)).metadata())
