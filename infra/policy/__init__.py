"""The ``duplexops-policies`` Pulumi policy pack (CrossGuard) for the stacks.

``rules`` holds the rules as pure functions (no Pulumi import; the stacks' tests call
``rules.check_resources``), ``pack`` wraps them into ``pulumi_policy`` policies, and ``__main__`` serves the
pack to the Pulumi CLI: ``pulumi preview --stack dev --policy-pack infra/policy`` (README.md here).
"""
