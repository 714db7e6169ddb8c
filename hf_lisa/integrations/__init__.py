"""LISA inside other fine-tuning tools: small glue modules, one per tool (see ``docs/integrations.md``).

* :mod:`.trl_sft`: ``python -m hf_lisa.integrations.trl_sft``, TRL's ``trl sft`` script with ``--peft_type LISA``
  (LISA adapters) and ``--lisa_full`` (full-parameter LISA);
* :mod:`.axolotl`: an axolotl plugin (``plugins: [hf_lisa.integrations.axolotl.LisaPlugin]``) that runs hf-lisa's
  schedule for axolotl's ``lisa_n_layers`` / ``lisa_step_interval`` keys instead of axolotl's own LISA callback;
* :mod:`.llamafactory`: a LLaMA-Factory recipe, ``run_exp`` with full fine-tuning and ``LisaCallback``;
* :mod:`.settings`: what they share: a tool's key names mapped to LISA's settings, checked by LISA's rules.

Nothing here is imported by ``import hf_lisa``; each module imports its tool only when it runs.
"""
