"""Our schedulers, registered the way torchx-nightly discovers plugins (``torchx_plugins.*``).

torchx 0.7.0 does not look here; it reads the ``torchx.schedulers`` entry points that
``compat/torchx07`` (the ``monarch-torchx-torchx07`` distribution) declares instead.
The registry collects a module's plugins in ``dir()`` order and TorchX's default scheduler is
the first one found, so the function names sort ``monarch_local`` first.
"""

from torchx.plugins import register


@register.scheduler(name="monarch_local")
def a_monarch_local(session_name: str, **kwargs: object):
    from monarch_torchx.schedulers.local import create_scheduler

    return create_scheduler(session_name, **kwargs)


@register.scheduler(name="monarch_slurm")
def b_monarch_slurm(session_name: str, **kwargs: object):
    from monarch_torchx.schedulers.slurm import create_scheduler

    return create_scheduler(session_name, **kwargs)


@register.scheduler(name="monarch_kubernetes")
def c_monarch_kubernetes(session_name: str, **kwargs: object):
    from monarch_torchx.schedulers.kubernetes import create_scheduler

    return create_scheduler(session_name, **kwargs)
