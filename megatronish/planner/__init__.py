"""``megatronish-plan``: a run's layout checked, its memory per rank and its step time predicted from
``pretrain_gpt.py``'s own flags, without starting a process group (docs/planner.md).

``hardware`` (the accelerator table, ``--hardware-file``, this CPU measured), ``state`` (parameter, gradient and
optimizer bytes counted on each rank's model built on the meta device), ``activations`` (per pipeline stage, from
``training/memory.py``'s formulas), ``perf`` (step time, MFU, collective bytes), ``plan`` (one layout's plan and
its report), ``search`` (valid layouts ranked), ``cli`` (the command line).
"""
