"""The two helpers every flag-group module uses (one flag per line, as Megatron-LM's table reads)."""


def flag(g, name, **kw):
    return g.add_argument(name, **kw)


on = dict(action="store_true")
