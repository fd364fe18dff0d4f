"""The ATOM adapter's old address: it lives in ATOM's engine profile, :mod:`layouts.engines.atom`.

Kept so that engine code written against ``layouts.atom.install_converted_weights`` (README,
ATOM integration patches) keeps working; new code imports ``layouts.engines.atom``.
"""

from .engines.atom import AtomInstallReport, atom_mtp_param_name, install_converted_weights

__all__ = ["AtomInstallReport", "atom_mtp_param_name", "install_converted_weights"]
