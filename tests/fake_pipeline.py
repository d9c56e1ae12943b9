"""megatron's pipeline parallelism on CPU threads (fake_comm.py), for the trainer's tests: a stage of
the CPU backend's TinyQwen as megatron builds a GPTModel of one pipeline stage (pre_process: it
embeds; post_process: it has the output layer; otherwise it takes and hands on hidden states
[T, B, H]), and megatron's schedule run by each stage's rank (forward only, or forward and backward
with the gradient of each stage's input handed back)."""
import torch

from aspc.backends.cpu.model import TinyQwen


class PipelineStage(torch.nn.Module):
    """Layers `layers` of `whole` (shared, not copied) as one pipeline stage's GPTModel: called as
    megatron calls it (ids, positions, [1, 1, T, T] mask True where masked); `set_input_tensor` is
    how the schedule hands it the previous stage's output."""

    def __init__(self, whole: TinyQwen, layers: range, pre_process: bool, post_process: bool):
        super().__init__()
        self.whole, self.layers = whole, layers
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def zero_grad_buffer(self):  # megatron DDP's, after each optimizer step (its gradients: .grad here)
        self.zero_grad(set_to_none=True)

    def forward(self, input_ids, position_ids, attention_mask):
        w = self.whole
        cos, sin = w.cos[position_ids][:, None], w.sin[position_ids][:, None]
        x = w.embed(input_ids) if self.pre_process else self.input_tensor.transpose(0, 1)
        for layer in self.layers:
            x = w.blocks[layer](x, cos, sin, ~attention_mask)
        return self.head(w.norm(x)) if self.post_process else x.transpose(0, 1).contiguous()

    def head(self, hidden):
        """The last stage's output layer over the final norm's output [B, T, H]."""
        return self.whole.logits(hidden)


def stages_of(whole: TinyQwen, pp: int) -> list[PipelineStage]:
    """`whole` cut into `pp` stages of consecutive layers (megatron's even split)."""
    per = whole.arch.layers // pp
    return [PipelineStage(whole, range(s * per, (s + 1) * per), s == 0, s == pp - 1) for s in range(pp)]


def pipeline_schedule(comm, group: list, hidden: int):
    """megatron's schedule (forward_backward_pipelining_without_interleaving, or
    forward_backward_no_pipelining for one stage) on this rank of pipeline `group`, one micro-batch
    at a time: receive the previous stage's output (megatron's p2p recv: here a broadcast in the two
    stages' pair), set it as the model's input, run the forward step and send the output on; the
    loss function runs on the last stage only (its 2-tuple loss divided by the micro-batch count
    before the backward), and only it returns the loss functions' results. Training, each stage's
    input gradient goes back to the previous stage, which runs its backward from it."""

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 forward_only):
        [stage], at, found = model, group.index(comm.rank), []
        before, after = group[max(at - 1, 0):at + 1], group[at:at + 2]
        for _ in range(num_microbatches):
            received = None
            if at > 0:
                received = comm.broadcast(torch.empty(seq_length, micro_batch_size, hidden), before[0], before)
                stage.set_input_tensor(received if forward_only else received.requires_grad_())
            output, loss_func = forward_step_func(data_iterator, stage)
            if at < len(group) - 1:
                comm.broadcast(output.detach(), comm.rank, after)
                if not forward_only:
                    output.backward(comm.broadcast(torch.empty_like(output), after[1], after))
            else:
                loss, stats = loss_func(output)
                found.append(stats)
                if not forward_only:
                    (loss / num_microbatches).backward()
            if received is not None and not forward_only:
                comm.broadcast(received.grad, comm.rank, before)
        return found

    return schedule
