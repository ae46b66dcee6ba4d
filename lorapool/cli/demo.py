"""``lorapool demo``: the full pipeline, or (``--engine-only``) the engine streaming live."""

import click

PROMPTS = [
    "Write a haiku about a queue of messages.",
    "In one sentence, what is a LoRA adapter?",
    "Name three uses of Redis streams.",
]


@click.command()
@click.option("--model", default=None, help="model directory (default: the prepared SmolLM2)")
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--engine-only", is_flag=True, help="only the in-process engine, no queue")
def demo(model, max_tokens, engine_only):
    """The pipeline: a producer, 2 workers over an embedded Redis, the audit table."""
    from rich.console import Console

    from lorapool.settings import smollm2_dir

    model = model or str(smollm2_dir())
    if engine_only:
        return engine_demo(model, max_tokens, Console())
    from lorapool.cli.demo_pipeline import run_demo

    return run_demo(model, max_tokens, Console())


def engine_demo(model: str, max_tokens: int, console) -> None:
    """Stream a few chat completions from one continuous batch to the terminal."""
    from rich.live import Live
    from rich.table import Table

    from lorapool import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=model))
    tokenizer = engine.get_tokenizer()
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
    )
    texts, status = {}, {}
    for i, prompt in enumerate(PROMPTS):
        chat = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        engine.add_request(f"chat-{i}", text, params)
        texts[f"chat-{i}"], status[f"chat-{i}"] = "", "waiting"

    def render() -> Table:
        table = Table(title="lorapool engine: one continuous batch", show_lines=True)
        table.add_column("prompt", style="bold", max_width=30)
        table.add_column("streamed completion")
        table.add_column("status")
        for i, prompt in enumerate(PROMPTS):
            table.add_row(prompt, texts[f"chat-{i}"], status[f"chat-{i}"])
        return table

    steps = 0
    with Live(render(), console=console, refresh_per_second=12) as live:
        while engine.has_unfinished_requests():
            for out in engine.step():
                texts[out.request_id] += out.outputs[0].text
                status[out.request_id] = out.outputs[0].finish_reason or "streaming"
            steps += 1
            live.update(render())
    console.print(f"{steps} engine steps, {len(PROMPTS)} requests batched together.")
