"""Batch work beside the online endpoint (mission item 4).

* ``requests`` (pure): the OpenAI Batch file format: parse and check input lines, build output lines.
* ``run`` (adapter): send a batch file's requests to the pdserve endpoint with bounded concurrency,
  retries and resume; input and output local or on S3. ``python -m runtime.batch run --help``.
* ``workflows`` (adapter, builds objects only): Argo Workflows for batch inference and a CronWorkflow for
  scheduled re-tuning from recorded traffic, built with hera and validated offline against the Argo CRD.
"""
