"""Batch work beside the online endpoint; its command face is runtime/faces/batch.py (`pdserve batch`).

* ``requests`` (pure): the OpenAI Batch file format: parse and check input lines, build output lines.
* ``run`` (adapter): send a batch file's requests to the pdserve endpoint with bounded concurrency,
  retries and resume; input and output local or on S3. ``pdserve batch run --help``.
* ``workflow_specs``, ``workflows``, ``workflow_validation`` (build objects only): the checked specs, the Argo
  Workflows for batch inference and a CronWorkflow for scheduled re-tuning from recorded traffic, built with hera
  and validated offline against the Argo CRD.
"""
