"""torchtitan configs that checkpoint through TieredCheckpointManager (see README.md beside this file).

Pick one by its module path and function name, from the repository root:

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module examples.torchtitan.config_registry --config llama3_debugmodel_tiered

CLI flags override the fields as for any torchtitan config: --checkpoint.interval 50,
--checkpoint.keep-latest-k 3, --checkpoint.load-step 100, --checkpoint.remote s3://bucket/run1.
"""

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.trainer import Trainer

from checkpointing.integrations.torchtitan import TieredCheckpointManager


def llama3_debugmodel_tiered() -> Trainer.Config:
    """torchtitan's debug model, saving every 5 steps to <dump_folder>/checkpoint, keeping 3."""
    config = llama3_debugmodel()
    config.checkpoint = TieredCheckpointManager.Config(
        enable=True,
        folder="checkpoint",  # under --dump_folder: the node-local tier (fast local disk)
        interval=5,
        keep_latest_k=3,
        async_mode="async",  # save() returns after the snapshot; the write runs in the background
        last_save_model_only=False,  # keep a resumable last step (True: the model alone, in export_dtype)
    )
    return config


def llama3_8b_tiered_s3() -> Trainer.Config:
    """Llama 3 8B: node-local steps every 500, each also uploaded to S3 (credentials from the environment)."""
    config = llama3_8b()
    config.checkpoint = TieredCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=500,
        keep_latest_k=2,  # node-local disk: the two newest
        remote="s3://my-bucket/llama3-8b/run1",  # durable tier: a replaced node restores from here
        keep_remote=10,
        last_save_model_only=True,  # the final step: weights only, in export_dtype
        export_dtype="bfloat16",
    )
    return config
