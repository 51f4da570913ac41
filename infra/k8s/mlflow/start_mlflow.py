"""Start `mlflow server` with its database URI built from the RDS-managed Secrets Manager secret.

RDS keeps the master credentials of the MLflow database in Secrets Manager (infra/terraform/mlflow_db.tf:
manage_master_user_password) as JSON with the keys `username` and `password`, and rotates them. This script
reads that secret as the pod's AWS identity (EKS Pod Identity role `<cluster>-mlflow`: GetSecretValue on that
one secret), so no Kubernetes Secret holds the password and a restart picks up a rotated one.

Environment (from infra/k8s/values, i.e. Terraform outputs): MLFLOW_DB_SECRET_ARN, MLFLOW_DB_ENDPOINT
(host:port), AWS_REGION; MLFLOW_DB_NAME (default "mlflow", mlflow_db.tf db_name). Arguments are passed to
`mlflow server` unchanged. The URI is never printed.
"""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import quote


def backend_store_uri(secret_string: str, endpoint: str, database: str) -> str:
    """postgresql://USER:PASSWORD@ENDPOINT/DATABASE from the secret's JSON (keys username, password).

    User and password are percent-encoded (RFC 3986 userinfo), as RDS passwords may hold ':', '@', '/' or '%'.

    Raises:
        ValueError: the secret is not JSON with string `username` and `password`, or endpoint/database is empty.
    """
    try:
        doc = json.loads(secret_string)
    except json.JSONDecodeError as e:
        raise ValueError("database secret is not JSON") from e
    user, password = (doc.get("username"), doc.get("password")) if isinstance(doc, dict) else (None, None)
    if not isinstance(user, str) or not isinstance(password, str) or not user:
        raise ValueError("database secret has no string 'username' and 'password'")
    if not endpoint or not database:
        raise ValueError("MLFLOW_DB_ENDPOINT and the database name must be set")
    return f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@{endpoint}/{quote(database, safe='')}"


def main(argv: list[str]) -> None:
    import boto3  # in the MLflow image: its S3 artifact store needs it

    arn = os.environ["MLFLOW_DB_SECRET_ARN"]
    secret = boto3.client("secretsmanager", region_name=os.environ.get("AWS_REGION")).get_secret_value(SecretId=arn)
    os.environ["MLFLOW_BACKEND_STORE_URI"] = backend_store_uri(
        secret["SecretString"], os.environ["MLFLOW_DB_ENDPOINT"], os.environ.get("MLFLOW_DB_NAME", "mlflow"))
    os.execvp("mlflow", ["mlflow", "server", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
