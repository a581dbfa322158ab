"""The bootstrap Pulumi project (``infra/bootstrap/Pulumi.yaml``): what a GCP project needs, once, before
CI can deploy the stacks. Run by a project owner after step 0 (``infra.gcp_apis.STEP_0_COMMAND``):

- ``roles``: the deployer's and the preview identity's roles, derived from the stacks' resource types;
- ``config``: the bootstrap's configuration (project, GitHub repository, environments);
- ``program``: the APIs the stacks need, the two service accounts and their roles, the Workload Identity
  Federation pool and provider for the repository's GitHub OIDC tokens, the bindings that let the
  workflows impersonate the accounts, and the variables CI reads.

How to run it: docs/deploying.md, "Step 0 and the bootstrap project".
"""
