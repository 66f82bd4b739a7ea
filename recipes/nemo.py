"""``from recipes.nemo import add_dcr_callback`` in a checkout: the helper itself ships in the
package as ``nemo_dcr.recipes.nemo`` (``from nemo_dcr.recipes import add_dcr_callback`` after
``pip install``)."""
from nemo_dcr.recipes.nemo import add_dcr_callback

__all__ = ["add_dcr_callback"]
