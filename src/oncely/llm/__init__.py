"""The model-provider seam: the ``LLM`` protocol (``base``), its
OpenAI-compatible adapter (``openai_compat``), and ``Model`` (``model``),
what a workflow step calls the model through. Import from the modules: the
package imports nothing, so that declaring a workflow loads no provider SDK."""
