"""Engines that join refit's group through their own protocol (an SGLang engine, a Dynamo
worker, an unmodified vLLM engine): the trainer rank that hosts the group and sends
(``trainer``), and engine ranks refit drives through the engine's own calls (``driven``)."""
