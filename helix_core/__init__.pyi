"""Type stub of the lazily loaded public surface (``__init__.py``): the same names."""

from helix_core.config import ClusterConfig as ClusterConfig
from helix_core.config import cache_dir as cache_dir
from helix_core.data import tokens as tokens
from helix_core.data.collate import pad_collate as pad_collate
from helix_core.data.costs import CostFit as CostFit
from helix_core.data.costs import CostModel as CostModel
from helix_core.data.costs import calibrate as calibrate
from helix_core.data.descriptors import CostProfile as CostProfile
from helix_core.data.descriptors import SampleDescriptor as SampleDescriptor
from helix_core.data.families import FAMILIES as FAMILIES
from helix_core.data.families import MODELS as MODELS
from helix_core.data.families import VideoSpec as VideoSpec
from helix_core.data.manifest import Manifest as Manifest
from helix_core.data.media import synth as synth
from helix_core.data.media.decode import decode_frames as decode_frames
from helix_core.data.media.probe import probe as probe
from helix_core.data.profiles import ProfileTable as ProfileTable
from helix_core.data.profiles import profile_dataset as profile_dataset
from helix_core.data.shards.dataset import WebDatasetClips as WebDatasetClips
from helix_core.data.shards.dataset import WebDatasetTextClips as WebDatasetTextClips
from helix_core.data.shards.write import write_shards as write_shards
from helix_core.data.storage.config import RemoteConfig as RemoteConfig
from helix_core.data.storage.config import check_storage_options as check_storage_options
from helix_core.data.video import (
    VideoClipDataset as VideoClipDataset,
)
from helix_core.data.video import (
    VideoTextDataset as VideoTextDataset,
)
from helix_core.data.video import (
    sample_generator as sample_generator,
)
from helix_core.errors import (
    ClusterError as ClusterError,
)
from helix_core.errors import (
    ManifestError as ManifestError,
)
from helix_core.errors import (
    SampleError as SampleError,
)
from helix_core.errors import (
    SpecError as SpecError,
)
from helix_core.launch.cluster import LocalCluster as LocalCluster
from helix_core.launch.sidecars import RaySidecars as RaySidecars
from helix_core.launch.sidecars import ray_sidecars as ray_sidecars
from helix_core.loader.loader import DistributedDataLoader as DistributedDataLoader
from helix_core.planning.gpu import GpuCost as GpuCost
from helix_core.security.tls import Tls as Tls
from helix_core.tier2.rebalance import GateArgs as GateArgs
from helix_core.tier2.rebalance import Rebalance as Rebalance

__version__: str
__all__: list[str]
