// Images dropped on the chat go into the message box, as if dropped there.
() => {
  const chat = document.querySelector('#chatbot');
  if (!chat) return;
  chat.addEventListener('dragover', (event) => event.preventDefault());
  chat.addEventListener('drop', (event) => {
    const input = document.querySelector('#chat-input input[type=file]');
    const images = Array.from(event.dataTransfer?.files || []).filter((f) => f.type.startsWith('image/'));
    if (!input || !images.length) return;
    event.preventDefault();
    const files = new DataTransfer();
    images.forEach((f) => files.items.add(f));
    input.files = files.files;
    input.dispatchEvent(new Event('change', { bubbles: true }));
  });
}
