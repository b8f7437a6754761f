"""groundflow's application layer: the ``groundflow`` command (``groundflow.cli``) and the
end-to-end demo (``groundflow.demo``, ``make demo``). The only package that imports both
``train`` and ``deploy``; nothing imports it.

Layers (imports flow one way): groundflow -> train, deploy -> policies, guidance -> dataset, envs.
"""
