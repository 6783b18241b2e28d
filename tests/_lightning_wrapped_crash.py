"""A child for test_lightning_wrapped.py: a fit inside AsyncCheckpointIO whose wrapper thread falls a few saves behind
(a slow disk, made by a gate job), ModelCheckpoint removing a top-k path while the wrapper's thread saves last.ckpt at
that same step (an alias of it), then a SIGKILL 0.3 s after that save call returned. Run: python this.py ROOT."""
import os, sys, json, signal, subprocess, tempfile, threading, time, warnings, logging
warnings.simplefilter("ignore")
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset
from checkpointing.integrations.lightning import LightningCheckpointIO
logging.getLogger("lightning").setLevel(logging.ERROR); logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(8, 1); self.big = torch.nn.Parameter(torch.zeros(2048, 4096))  # 32 MiB
    def training_step(self, b, i):
        self.log("m", float((self.global_step * 7) % 5))  # steps 1..6 get m = 0, 2, 4, 1, 3, 0
        return torch.nn.functional.mse_loss(self.l(b[0]), b[1]) + self.big.sum() * 0
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

gate = threading.Event()

class SlowQueue(AsyncCheckpointIO):  # the wrapper's thread falls behind by a few saves (a slow disk), from last.ckpt@2 on
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        crash = os.environ.get("CRASH") == "1" and os.path.basename(str(path)) == "last.ckpt" and checkpoint["global_step"] == 2
        if os.path.basename(str(path)) == "last.ckpt" and checkpoint["global_step"] == 2:
            self._ensure_setup(); self._executor.submit(gate.wait, 60)
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        if crash:  # the process dies 0.3 s after this save call returned on the wrapper's thread
            self._executor.submit(lambda: (time.sleep(0.3), os.kill(os.getpid(), signal.SIGKILL)))

class Open(Callback):
    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == 4:
            time.sleep(2.0)  # step=2.ckpt's save commits before ModelCheckpoint removes it (runs after this callback)
            gate.set()  # the queue moves on: last.ckpt@2 reaches the plugin
            time.sleep(0.02)

def fit(root, ckpt_path=None):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    mc = ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=1, save_top_k=2, monitor="m", mode="min",
                         save_last=True, filename="{step}")
    t = pl.Trainer(max_epochs=1, max_steps=8, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, plugins=[SlowQueue(LightningCheckpointIO(os.path.join(root, "store")))], callbacks=[Open(), mc])
    t.fit(Tiny(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8), ckpt_path=ckpt_path)
    return t


if __name__ == "__main__":
    fit(sys.argv[1], ckpt_path=sys.argv[2] if len(sys.argv) > 2 else None)
