// Keyboard use: the settings sidebar comes after the chat in tab order (it is drawn fixed at the
// side, so its place in the document changes only the order), and a menu's list closes when the
// focus leaves it (Gradio's stays open over the next controls, with the chosen option in it). After a
// file is chosen with the clip button, the focus is back in that message box, to type the question.
// Editing an earlier question: Enter sends it (Shift+Enter: a new line), Esc cancels. Elsewhere Esc
// stops the answer on its way (or the one waiting in line), as Stop does, in the tab on screen.
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
  document.addEventListener('keydown', (event) => {
    if (event.key !== 'Enter' && event.key !== 'Escape' || event.isComposing || event.defaultPrevented) return;
    const editing = event.target.closest?.('#chatbot') && event.target.matches('textarea.edit-textarea');
    if (editing && !(event.key === 'Enter' && event.shiftKey)) {
      event.preventDefault();
      document.querySelector(`#chatbot button[aria-label=${event.key === 'Enter' ? 'Submit' : 'Cancel'}]`)?.click();
    } else if (event.key === 'Escape' && !event.target.matches?.('input[role=combobox]')) {
      const stop = [...document.querySelectorAll('#chat-stop, #ab-stop')].find((b) => b.offsetParent && !b.disabled);
      stop?.click();
    }
  });
}
