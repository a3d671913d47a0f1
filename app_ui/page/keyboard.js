// Keyboard use: the settings sidebar comes after the chat in tab order (it is drawn fixed at the
// side, so its place in the document changes only the order), and a menu's list closes when the
// focus leaves it (Gradio's stays open over the next controls, with the chosen option in it). After a
// file is chosen with the clip button, the focus is back in that message box, to type the question.
() => {
  const sidebar = document.querySelector('.sidebar');
  if (sidebar) sidebar.parentElement.append(sidebar);
  document.addEventListener('focusout', (event) => {
    const menu = event.target.closest?.('.block');
    if (!event.target.matches?.('input[role=combobox]') || !menu || menu.contains(event.relatedTarget)) return;
    event.target.dispatchEvent(new KeyboardEvent('keydown', { key: 'Escape', bubbles: true }));
  }, true);
  document.addEventListener('change', (event) => {
    const box = event.target.matches?.('input[type=file]') && event.target.closest('#chat-input, #ab-input');
    if (box) setTimeout(() => box.querySelector('textarea')?.focus({ preventScroll: true }), 0);
  }, true);
}
